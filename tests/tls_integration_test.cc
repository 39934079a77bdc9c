// A real kvtierd over TLS and mutual TLS, with certificates made for the test by
// tests/tls/make_test_certs.sh: plaintext and untrusted clients are refused, a client
// certificate names a tenant, and a rotated server certificate is picked up without a
// restart. Bad certificate files stop the daemon at start-up with the option's name; a
// bad file at a reload is logged and the previous certificate keeps serving.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "client/kvtier_client.h"
#include "tests/support/daemon_process.h"
#include "tests/support/test_data.h"

namespace kvtier {
namespace {

using testing::DaemonProcess;
using testing::Eventually;
using testing::KeyOf;
using testing::LayoutOfMiB;
using testing::MakeTempDir;
using testing::PatternBytes;

class TlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    certs_ = new std::string(MakeTempDir("kvtier-certs"));
    const std::string cmd = std::string("bash ") + KVTIER_CERT_SCRIPT + " " + *certs_;
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  }
  static std::string Cert(const std::string& name) { return *certs_ + "/" + name; }

  // Starts kvtierd with TLS from copies of server.{pem,key} (so that a test can rotate
  // them) and `extra` flags.
  void Start(std::vector<std::string> extra) {
    dir_ = MakeTempDir("kvtierd-tls");
    cert_ = dir_ + ".cert.pem";
    key_ = dir_ + ".key.pem";
    std::filesystem::copy_file(Cert("server.pem"), cert_);
    std::filesystem::copy_file(Cert("server.key"), key_);
    extra.push_back("--tls-cert-file=" + cert_);
    extra.push_back("--tls-key-file=" + key_);
    auto d = DaemonProcess::Start(dir_, std::move(extra));
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_.emplace(*std::move(d));
  }

  absl::StatusOr<std::unique_ptr<KvTierClient>> Client(const std::string& ca,
                                                       const std::string& client_cert = "") {
    ClientOptions o;
    o.tls_ca_file = ca.empty() ? "" : Cert(ca);
    if (!client_cert.empty()) {
      o.tls_cert_file = Cert(client_cert + ".pem");
      o.tls_key_file = Cert(client_cert + ".key");
    }
    o.rpc_deadline = absl::Seconds(10);
    return KvTierClient::Connect(daemon_->target(), o);
  }

  // Whether a fresh client that trusts `ca` gets an RPC through (a new handshake).
  bool Served(const std::string& ca) {
    auto c = Client(ca);
    return c.ok() && (*c)->RegisterLayout(LayoutOfMiB(1)).ok();
  }

  // Whether the daemon is still running: it is not reaped until Terminate or Kill, so a
  // daemon that died is a zombie ('Z') until then.
  bool Running() const {
    std::ifstream stat("/proc/" + std::to_string(daemon_->pid()) + "/stat");
    std::string pid, comm, state;
    return static_cast<bool>(stat >> pid >> comm >> state) && state != "Z";
  }

  bool Logged(const std::string& text) const {
    return daemon_->ReadLog().find(text) != std::string::npos;
  }

  static std::string* certs_;
  std::string dir_, cert_, key_;
  std::optional<DaemonProcess> daemon_;
};
std::string* TlsTest::certs_ = nullptr;

TEST_F(TlsTest, ServesTlsAndRefusesPlaintextAndUntrustedServers) {
  Start({});
  auto good = Client("ca.pem");
  ASSERT_TRUE(good.ok());
  auto r = (*good)->RegisterLayout(LayoutOfMiB(1));
  ASSERT_TRUE(r.ok()) << r.status();
  const std::string data = PatternBytes(1, 1 << 20);
  ASSERT_TRUE((*good)->Put(r->namespace_id, {ChunkToPut{KeyOf(1), data, 256}}).ok());
  auto got = (*good)->Get(r->namespace_id, {KeyOf(1)});
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), 1u);
  EXPECT_EQ((*got)[0].data, data);

  auto plaintext = Client("");
  ASSERT_TRUE(plaintext.ok());
  EXPECT_EQ((*plaintext)->RegisterLayout(LayoutOfMiB(1)).status().code(),
            absl::StatusCode::kUnavailable);
  // A client that trusts another CA does not accept the daemon's certificate.
  auto distrust = Client("ca2.pem");
  ASSERT_TRUE(distrust.ok());
  EXPECT_EQ((*distrust)->RegisterLayout(LayoutOfMiB(1)).status().code(),
            absl::StatusCode::kUnavailable);
}

TEST_F(TlsTest, MutualTlsMapsTheClientCertificateToATenant) {
  const std::string tenants = MakeTempDir("kvtier-tenants") + "/tenants";
  std::ofstream(tenants) << "tenant team-a\ncert team-a worker-a.example\n";
  Start({"--tls-client-ca-file=" + Cert("ca.pem"), "--tenants-file=" + tenants});
  auto a = Client("ca.pem", "client-a");
  ASSERT_TRUE(a.ok());
  auto r = (*a)->RegisterLayout(LayoutOfMiB(1));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*a)->Stats().status().code(), absl::StatusCode::kPermissionDenied)
      << "team-a is a tenant, not an admin";
  // No client certificate, or one from a CA the daemon does not trust (same CN): the
  // handshake fails.
  auto anonymous = Client("ca.pem");
  ASSERT_TRUE(anonymous.ok());
  EXPECT_EQ((*anonymous)->RegisterLayout(LayoutOfMiB(1)).status().code(),
            absl::StatusCode::kUnavailable);
  auto forged = Client("ca.pem", "client-x");
  ASSERT_TRUE(forged.ok());
  EXPECT_EQ((*forged)->RegisterLayout(LayoutOfMiB(1)).status().code(),
            absl::StatusCode::kUnavailable);
}

TEST_F(TlsTest, ARotatedCertificateIsServedWithoutARestart) {
  Start({"--tls-reload-interval=1s"});
  auto old_ca = Client("ca.pem");
  ASSERT_TRUE(old_ca.ok());
  ASSERT_TRUE((*old_ca)->RegisterLayout(LayoutOfMiB(1)).ok());
  // Rotate to a certificate from ca2: written beside, then renamed over (atomically).
  std::filesystem::copy_file(Cert("server2.key"), key_ + ".new");
  std::filesystem::copy_file(Cert("server2.pem"), cert_ + ".new");
  std::filesystem::rename(key_ + ".new", key_);
  std::filesystem::rename(cert_ + ".new", cert_);
  // New connections get the new certificate once gRPC's file watcher has re-read the
  // files. Its timer (1 s here) is inside gRPC and cannot be injected, so this polls for
  // the outcome, with a generous bound and no claim about how long it took; the daemon
  // is never restarted.
  const pid_t pid = daemon_->pid();
  bool rotated = false;
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  while (!rotated && absl::Now() < give_up) {
    auto fresh = Client("ca2.pem");
    ASSERT_TRUE(fresh.ok());
    rotated = (*fresh)->RegisterLayout(LayoutOfMiB(1)).ok();
    if (!rotated) absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_TRUE(rotated);
  EXPECT_EQ(daemon_->pid(), pid);
}

TEST_F(TlsTest, ABadCertificateFileAtAReloadIsLoggedAndTheOldOneKeepsServing) {
  Start({"--tls-reload-interval=1s"});
  const pid_t pid = daemon_->pid();
  ASSERT_TRUE(Served("ca.pem"));
  // Truncated, as `cp` or `cat new > server.pem` leaves it for a moment. gRPC, reading
  // it directly, aborted the daemon on an empty certificate. The reload timer is inside
  // the daemon and cannot be injected, so the test waits for the reload's verdict in the
  // log (generous bound), then checks that the old certificate still serves.
  std::ofstream(cert_, std::ios::trunc).close();
  ASSERT_TRUE(Eventually([&] { return Logged("option tls_cert_file: " + cert_ + ": is empty"); }))
      << daemon_->ReadLog();
  EXPECT_TRUE(Running());
  EXPECT_TRUE(Served("ca.pem"));
  // Not PEM: every new handshake failed until the file was fixed.
  std::ofstream(cert_, std::ios::trunc) << "not a certificate\n";
  ASSERT_TRUE(Eventually(
      [&] { return Logged("option tls_cert_file: " + cert_ + ": holds no PEM certificate"); }))
      << daemon_->ReadLog();
  EXPECT_TRUE(Running());
  EXPECT_TRUE(Served("ca.pem"));
  EXPECT_FALSE(Served("ca2.pem"));

  // A rotation to server2 (from ca2), written in place: key first (for a while it does
  // not match the certificate, and is refused too), then the certificate. It is served
  // once both are whole, without a restart.
  std::filesystem::copy_file(Cert("server2.key"), key_,
                             std::filesystem::copy_options::overwrite_existing);
  std::filesystem::copy_file(Cert("server2.pem"), cert_,
                             std::filesystem::copy_options::overwrite_existing);
  bool rotated = false;
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  while (!rotated && absl::Now() < give_up) {
    rotated = Served("ca2.pem");
    if (!rotated) absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_TRUE(rotated) << daemon_->ReadLog();
  EXPECT_FALSE(Served("ca.pem"));
  EXPECT_EQ(daemon_->pid(), pid);
  EXPECT_TRUE(Running());
  EXPECT_TRUE(Logged("TLS certificate reloaded")) << daemon_->ReadLog();
  // gRPC was only ever given checked files: it never reported one it could not use.
  EXPECT_FALSE(Logged("Update handshaker factory failed")) << daemon_->ReadLog();
}

// A client given a file that is not PEM is refused at Connect, naming the field and the
// file (gRPC alone fails every call with "empty address list").
TEST(TlsClientTest, NonPemFilesAreRefusedAtConnectNamingTheField) {
  const std::string dir = MakeTempDir("kvtier-client-tls");
  const std::string junk = dir + "/junk.pem";
  std::ofstream(junk) << "not a certificate\n";
  const std::string certs = MakeTempDir("kvtier-client-certs");
  const std::string cmd = std::string("bash ") + KVTIER_CERT_SCRIPT + " " + certs;
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  struct Case {
    std::string ca, cert, key, named;  // `named`: what the error must say.
  } cases[] = {
      {junk, "", "", "tls_ca_file: " + junk + " holds no PEM certificate"},
      {certs + "/ca.pem", junk, certs + "/client-a.key",
       "tls_cert_file: " + junk + " holds no PEM certificate"},
      {certs + "/ca.pem", certs + "/client-a.pem", junk,
       "tls_key_file: " + junk + " holds no PEM private key"},
      // A certificate where the key belongs is not a key.
      {certs + "/ca.pem", certs + "/client-a.pem", certs + "/client-a.pem",
       "tls_key_file: " + certs + "/client-a.pem holds no PEM private key"},
      // Another certificate's key, and an encrypted key: gRPC alone said only "empty
      // address list" on every call.
      {certs + "/ca.pem", certs + "/client-a.pem", certs + "/server.key",
       "tls_key_file: " + certs + "/server.key does not match the certificate in tls_cert_file"},
      {certs + "/ca.pem", certs + "/client-a.pem", dir + "/encrypted.key",
       "tls_key_file: " + dir + "/encrypted.key holds no unencrypted PEM private key"},
  };
  const std::string encrypt = "openssl pkey -in " + certs + "/client-a.key -aes256 -passout " +
                              "pass:secret -out " + dir + "/encrypted.key 2>/dev/null";
  ASSERT_EQ(std::system(encrypt.c_str()), 0) << encrypt;
  for (const Case& c : cases) {
    ClientOptions o;
    o.tls_ca_file = c.ca;
    o.tls_cert_file = c.cert;
    o.tls_key_file = c.key;
    auto client = KvTierClient::Connect("127.0.0.1:1", o);
    ASSERT_FALSE(client.ok()) << c.named;
    EXPECT_EQ(client.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(client.status().message().find(c.named), std::string::npos) << client.status();
  }
  ClientOptions good;
  good.tls_ca_file = certs + "/ca.pem";
  EXPECT_TRUE(KvTierClient::Connect("127.0.0.1:1", good).ok());
}

TEST_F(TlsTest, BadCertificateFilesStopStartUpNamingTheOption) {
  const std::string dir = MakeTempDir("kvtierd-badtls");
  const std::string junk = dir + ".junk.pem";
  std::ofstream(junk) << "not a certificate\n";
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const Case cases[] = {
      {{"--tls-cert-file=" + junk, "--tls-key-file=" + Cert("server.key")}, "option tls_cert_file"},
      {{"--tls-cert-file=" + Cert("server.pem"), "--tls-key-file=" + junk}, "option tls_key_file"},
      {{"--tls-cert-file=" + Cert("server.pem"), "--tls-key-file=" + Cert("server2.key")},
       "does not match"},
      {{"--tls-cert-file=" + Cert("server.pem"), "--tls-key-file=" + Cert("server.key"),
        "--tls-client-ca-file=" + dir + ".missing"},
       "option tls_client_ca_file"},
  };
  int i = 0;
  for (const Case& c : cases) {
    const std::string data_dir = dir + "/" + std::to_string(i++);
    auto d = DaemonProcess::Start(data_dir, c.args);
    EXPECT_FALSE(d.ok()) << c.message;
    std::ifstream log(data_dir + ".log");
    std::stringstream text;
    text << log.rdbuf();
    EXPECT_NE(text.str().find(c.message), std::string::npos) << text.str();
  }
}

}  // namespace
}  // namespace kvtier
