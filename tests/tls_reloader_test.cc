// TlsReloader: what gRPC reads (the staged copy) changes only to a checked, complete
// generation. Empty, garbage, mismatched and missing files are refused naming the option
// and leave the staged bytes alone; a valid rotation is staged with a new generation and
// mtimes that strictly increase (gRPC's read-retry check depends on them). No thread:
// the interval is infinite and each test calls ReloadNow itself.
#include "server/tls_reloader.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>

#include "absl/time/clock.h"
#include "tests/support/fake_clock.h"

namespace kvtier {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

// Polls `cond` (5 ms apart, up to 30 s): the reload thread runs on its own clock.
bool Eventually(const std::function<bool()>& cond) {
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (!cond()) {
    if (absl::Now() > give_up) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void WriteFile(const std::string& path, const std::string& data) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << data;
}

int64_t MtimeSeconds(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(stat(path.c_str(), &st), 0) << path;
  return st.st_mtim.tv_sec;
}

class TlsReloaderTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    certs_ = new TempDir("kvtier-reloader-certs");
    const std::string cmd = std::string("bash ") + KVTIER_CERT_SCRIPT + " " + certs_->path();
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  }
  static void TearDownTestSuite() {
    delete certs_;
    certs_ = nullptr;
  }
  static std::string Cert(const std::string& name) { return certs_->path() + "/" + name; }

  // Operator files copied from server.{pem,key} (and ca.pem with `mutual`), so that a
  // test can break and rotate them; then a reloader over them.
  void SetUp() override {
    dir_ = tmp_.path();
    cert_ = dir_ + "/server.pem";
    key_ = dir_ + "/server.key";
    ca_ = dir_ + "/clients.pem";
    fs::copy_file(Cert("server.pem"), cert_);
    fs::copy_file(Cert("server.key"), key_);
    fs::copy_file(Cert("ca.pem"), ca_);
  }

  // Options over the operator files, staged in <dir>/stage, reloaded only by ReloadNow.
  TlsReloaderOptions Options(bool mutual = false) const {
    TlsReloaderOptions o;
    o.cert_file = cert_;
    o.key_file = key_;
    if (mutual) o.client_ca_file = ca_;
    o.stage_dir = dir_ + "/stage";
    o.interval = absl::InfiniteDuration();
    return o;
  }

  void Create(bool mutual = false) {
    auto r = TlsReloader::Create(Options(mutual));
    ASSERT_TRUE(r.ok()) << r.status();
    reloader_ = *std::move(r);
  }

  // The bytes gRPC would read now.
  struct Staged {
    std::string key, cert, ca;
  };
  Staged ReadStaged() const {
    Staged s{ReadFile(reloader_->staged_key_file()), ReadFile(reloader_->staged_cert_file()),
             ""};
    if (!reloader_->staged_ca_file().empty()) s.ca = ReadFile(reloader_->staged_ca_file());
    return s;
  }

  static TempDir* certs_;
  TempDir tmp_{"kvtier-reloader"};
  std::string dir_, cert_, key_, ca_;
  std::unique_ptr<TlsReloader> reloader_;  // Declared after tmp_: gone before it.
};
TempDir* TlsReloaderTest::certs_ = nullptr;

TEST_F(TlsReloaderTest, StagesTheOperatorFilesPrivately) {
  Create(/*mutual=*/true);
  EXPECT_EQ(reloader_->generation(), 1u);
  const Staged s = ReadStaged();
  EXPECT_EQ(s.cert, ReadFile(Cert("server.pem")));
  EXPECT_EQ(s.key, ReadFile(Cert("server.key")));
  EXPECT_EQ(s.ca, ReadFile(Cert("ca.pem")));
  EXPECT_EQ(reloader_->staged_cert_file().rfind(dir_ + "/stage/", 0), 0u)
      << reloader_->staged_cert_file();
  // Only the daemon's user may read the copy of the private key.
  EXPECT_EQ(fs::status(dir_ + "/stage").permissions() & fs::perms::all, fs::perms::owner_all);
  EXPECT_EQ(fs::status(reloader_->staged_key_file()).permissions() & fs::perms::all,
            fs::perms::owner_read | fs::perms::owner_write);
  // Unchanged files: nothing new is staged.
  EXPECT_TRUE(reloader_->ReloadNow().ok());
  EXPECT_EQ(reloader_->generation(), 1u);
}

TEST_F(TlsReloaderTest, BadFilesAreRefusedNamingTheOptionAndTheStagedCopyStays) {
  Create(/*mutual=*/true);
  const Staged before = ReadStaged();
  const std::string good_cert = ReadFile(cert_);
  const std::string good_key = ReadFile(key_);
  const std::string good_ca = ReadFile(ca_);
  struct Case {
    const char* name;
    std::string file;      // Which operator file is broken...
    std::string contents;  // ...and what it holds (unused when `remove`).
    bool remove;
    std::string message;   // Expected in the status.
  };
  const Case cases[] = {
      {"empty cert", cert_, "", false, "option tls_cert_file: " + cert_ + ": is empty"},
      {"empty key", key_, "", false, "option tls_key_file: " + key_ + ": is empty"},
      {"garbage cert", cert_, "not a certificate\n", false,
       "option tls_cert_file: " + cert_ + ": holds no PEM certificate"},
      {"half-written cert", cert_, good_cert.substr(0, good_cert.size() / 2), false,
       "option tls_cert_file: " + cert_},
      {"garbage key", key_, "not a key\n", false, "option tls_key_file: " + key_},
      {"mismatched key", key_, ReadFile(Cert("server2.key")), false,
       "option tls_key_file: " + key_ + ": does not match"},
      {"missing cert", cert_, "", true, "option tls_cert_file: " + cert_ + ": cannot open"},
      {"missing key", key_, "", true, "option tls_key_file: " + key_ + ": cannot open"},
      {"empty client CA", ca_, "", false, "option tls_client_ca_file: " + ca_ + ": is empty"},
      {"missing client CA", ca_, "", true, "option tls_client_ca_file: " + ca_},
  };
  uint64_t failures = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    if (c.remove) {
      fs::remove(c.file);
    } else {
      WriteFile(c.file, c.contents);
    }
    const absl::Status s = reloader_->ReloadNow();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(c.message), std::string::npos) << s;
    EXPECT_EQ(reloader_->generation(), 1u);
    EXPECT_EQ(reloader_->reload_failures(), ++failures);
    const Staged after = ReadStaged();
    EXPECT_EQ(after.cert, before.cert);
    EXPECT_EQ(after.key, before.key);
    EXPECT_EQ(after.ca, before.ca);
    WriteFile(cert_, good_cert);
    WriteFile(key_, good_key);
    WriteFile(ca_, good_ca);
  }
  // Fixed again: the same bytes as staged, so still generation 1.
  EXPECT_TRUE(reloader_->ReloadNow().ok());
  EXPECT_EQ(reloader_->generation(), 1u);
}

// Logs go to stderr (one write(2) per line), captured here.
int Count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST_F(TlsReloaderTest, AProblemIsWarnedOnceUntilItChangesOrIsFixed) {
  Create();
  ::testing::internal::CaptureStderr();
  WriteFile(cert_, "");
  for (int i = 0; i < 3; ++i) EXPECT_FALSE(reloader_->ReloadNow().ok());
  WriteFile(cert_, "not a certificate\n");
  for (int i = 0; i < 3; ++i) EXPECT_FALSE(reloader_->ReloadNow().ok());
  fs::copy_file(Cert("server.pem"), cert_, fs::copy_options::overwrite_existing);
  EXPECT_TRUE(reloader_->ReloadNow().ok());
  WriteFile(cert_, "");
  EXPECT_FALSE(reloader_->ReloadNow().ok());
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(Count(log, "is empty"), 2) << log;  // Once, and again after the fix.
  EXPECT_EQ(Count(log, "holds no PEM certificate"), 1) << log;
  EXPECT_EQ(Count(log, "TLS files valid again"), 1) << log;
  EXPECT_EQ(reloader_->reload_failures(), 7u);
  EXPECT_EQ(reloader_->generation(), 1u);
}

TEST_F(TlsReloaderTest, BadFilesStopCreateNamingTheOption) {
  WriteFile(cert_, "");
  auto r = TlsReloader::Create(Options());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("option tls_cert_file"), std::string::npos) << r.status();
  EXPECT_FALSE(fs::exists(dir_ + "/stage")) << "nothing is written before the files pass";
}

// A FIFO (or anything but a regular file) at a path is refused at once; opening it
// blocked until something wrote to it, so start-up (or a reload, and shutdown with it)
// hung.
TEST_F(TlsReloaderTest, AFifoIsRefusedNotWaitedOn) {
  fs::remove(key_);
  ASSERT_EQ(mkfifo(key_.c_str(), 0600), 0) << std::strerror(errno);
  auto r = TlsReloader::Create(Options());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("option tls_key_file"), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find("not a regular file"), std::string::npos) << r.status();
}

TEST_F(TlsReloaderTest, AValidRotationIsStagedAsANewGenerationWithLaterMtimes) {
  Create(/*mutual=*/true);
  const int64_t key_mtime1 = MtimeSeconds(reloader_->staged_key_file());
  const int64_t cert_mtime1 = MtimeSeconds(reloader_->staged_cert_file());
  const std::string first_dir = fs::read_symlink(dir_ + "/stage/current").string();

  // A new certificate and key (from ca2), and a new client CA.
  WriteFile(cert_, ReadFile(Cert("server2.pem")));
  WriteFile(key_, ReadFile(Cert("server2.key")));
  WriteFile(ca_, ReadFile(Cert("ca2.pem")));
  ASSERT_TRUE(reloader_->ReloadNow().ok());
  EXPECT_EQ(reloader_->generation(), 2u);
  Staged s = ReadStaged();
  EXPECT_EQ(s.cert, ReadFile(Cert("server2.pem")));
  EXPECT_EQ(s.key, ReadFile(Cert("server2.key")));
  EXPECT_EQ(s.ca, ReadFile(Cert("ca2.pem")));
  EXPECT_NE(fs::read_symlink(dir_ + "/stage/current").string(), first_dir);
  // gRPC compares whole-second mtimes of key and cert before and after reading them: a
  // read that straddles the swap must see them change.
  const int64_t key_mtime2 = MtimeSeconds(reloader_->staged_key_file());
  const int64_t cert_mtime2 = MtimeSeconds(reloader_->staged_cert_file());
  EXPECT_GT(key_mtime2, key_mtime1);
  EXPECT_GT(cert_mtime2, cert_mtime1);

  // And back, in quick succession (well within a second): still strictly increasing.
  WriteFile(cert_, ReadFile(Cert("server.pem")));
  WriteFile(key_, ReadFile(Cert("server.key")));
  ASSERT_TRUE(reloader_->ReloadNow().ok());
  EXPECT_EQ(reloader_->generation(), 3u);
  s = ReadStaged();
  EXPECT_EQ(s.cert, ReadFile(Cert("server.pem")));
  EXPECT_EQ(s.key, ReadFile(Cert("server.key")));
  EXPECT_GT(MtimeSeconds(reloader_->staged_key_file()), key_mtime2);
  EXPECT_GT(MtimeSeconds(reloader_->staged_cert_file()), cert_mtime2);

  // The generation in use and the one before it stay; older ones are removed.
  int generations = 0;
  for (const fs::directory_entry& e : fs::directory_iterator(dir_ + "/stage")) {
    if (e.path().filename().string()[0] == 'g') ++generations;
  }
  EXPECT_EQ(generations, 2);
}

TEST_F(TlsReloaderTest, ExitAndStartUpCleanTheCopyAndASecondReloaderIsRefused) {
  Create();
  ASSERT_TRUE(fs::exists(dir_ + "/stage/g1"));
  // Another reloader on the same stage directory (a second daemon on the same
  // data_dir) must not clean the copy this one serves from.
  auto second = TlsReloader::Create(Options());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition) << second.status();
  EXPECT_EQ(ReadFile(reloader_->staged_cert_file()), ReadFile(cert_));

  // Once this one is gone, no copy of the key is left; files it does not own are.
  WriteFile(cert_, ReadFile(Cert("server2.pem")));
  WriteFile(key_, ReadFile(Cert("server2.key")));
  ASSERT_TRUE(reloader_->ReloadNow().ok());
  ASSERT_TRUE(fs::exists(dir_ + "/stage/g2/key.pem"));
  WriteFile(dir_ + "/stage/operator-notes", "keep");
  reloader_.reset();
  for (const char* gone : {"g1", "g2", "current", "current.tmp"}) {
    EXPECT_FALSE(fs::exists(fs::symlink_status(dir_ + "/stage/" + gone))) << gone;
  }
  EXPECT_EQ(ReadFile(dir_ + "/stage/operator-notes"), "keep");

  // What a crashed run left is removed at start-up, which stages generation 1 again.
  fs::create_directory(dir_ + "/stage/g7");
  WriteFile(dir_ + "/stage/g7/key.pem", ReadFile(key_));
  fs::create_directory_symlink("g7", dir_ + "/stage/current");
  Create();
  EXPECT_EQ(reloader_->generation(), 1u);
  EXPECT_FALSE(fs::exists(dir_ + "/stage/g7"));
  EXPECT_EQ(ReadFile(reloader_->staged_key_file()), ReadFile(key_));
  EXPECT_EQ(ReadFile(dir_ + "/stage/operator-notes"), "keep");
}

TEST_F(TlsReloaderTest, TheThreadReloadsOnItsIntervalAndStopsPromptly) {
  TlsReloaderOptions o = Options();
  o.interval = absl::Milliseconds(10);
  auto r = TlsReloader::Create(o);
  ASSERT_TRUE(r.ok()) << r.status();
  WriteFile(cert_, "");  // Refused by the thread, repeatedly, without touching the copy.
  EXPECT_TRUE(Eventually([&] { return (*r)->reload_failures() >= 2; }));
  WriteFile(key_, ReadFile(Cert("server2.key")));
  WriteFile(cert_, ReadFile(Cert("server2.pem")));
  EXPECT_TRUE(Eventually([&] { return (*r)->generation() == 2; }));
  EXPECT_EQ(ReadFile((*r)->staged_cert_file()), ReadFile(Cert("server2.pem")));
  // With a long interval the destructor must not wait it out.
  o.interval = absl::Hours(1);
  o.stage_dir = dir_ + "/stage2";
  auto slow = TlsReloader::Create(o);
  ASSERT_TRUE(slow.ok()) << slow.status();
  const absl::Time start = absl::Now();
  slow->reset();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

}  // namespace
}  // namespace kvtier
