// The `kvtier` CLI against a real kvtierd: register, put and get files, lookup, stats,
// keys, and its error paths.
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "gtest/gtest.h"
#include "storage/chunk_key.h"
#include "tests/support/daemon_process.h"
#include "tests/support/test_data.h"

namespace kvtier {
namespace {

using testing::RunCommand;

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::MakeTempDir("kvtier-cli");
    auto d = testing::DaemonProcess::Start(dir_ + "/data", {"--ram-capacity=64MiB"});
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_.emplace(*std::move(d));
  }

  testing::CommandResult Cli(std::vector<std::string> args) {
    args.insert(args.begin(), {KVTIER_CLI_PATH, "--target", daemon_->target()});
    return RunCommand(args);
  }

  std::string WriteFile(const std::string& name, const std::string& bytes) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path, std::ios::binary) << bytes;
    return path;
  }

  static std::string ReadFile(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

  // Registers the 2 MiB layout and returns its namespace id as printed.
  std::string Register() {
    auto r = Cli({"register", "--model-id", "cli-model", "--dtype", "fp16", "--layers", "2",
                  "--kv-heads", "8", "--head-dim", "128", "--tokens-per-chunk", "256"});
    EXPECT_EQ(r.exit_code, 0) << r.output;
    for (absl::string_view line : absl::StrSplit(r.output, '\n')) {
      if (absl::ConsumePrefix(&line, "namespace_id")) {
        return std::string(absl::StripAsciiWhitespace(line));
      }
    }
    ADD_FAILURE() << "no namespace_id line in: " << r.output;
    return "";
  }

  std::string dir_;
  std::optional<testing::DaemonProcess> daemon_;
};

TEST_F(CliTest, RegisterPutLookupGetStats) {
  const std::string ns = Register();
  ASSERT_EQ(ns.size(), 16u);
  // The CLI's namespace id is the one the key scheme defines.
  LayoutSpec l = testing::LayoutOfMiB(2, "cli-model");
  l.model_revision = "";
  char expected[17];
  std::snprintf(expected, sizeof expected, "%016lx", l.NamespaceId());
  EXPECT_EQ(ns, expected);

  const std::string key = testing::KeyOf(5).ToHex();
  const std::string payload = testing::PatternBytes(5, 2 << 20);
  const std::string in = WriteFile("chunk.bin", payload);
  auto put = Cli({"put", "--namespace", ns, key + "=" + in});
  ASSERT_EQ(put.exit_code, 0) << put.output;
  EXPECT_NE(put.output.find("1 stored"), std::string::npos) << put.output;

  auto lookup = Cli({"lookup", "--namespace", ns, key, testing::KeyOf(6).ToHex()});
  ASSERT_EQ(lookup.exit_code, 0) << lookup.output;
  EXPECT_NE(lookup.output.find("ram"), std::string::npos) << lookup.output;
  EXPECT_NE(lookup.output.find("absent"), std::string::npos) << lookup.output;

  const std::string out = dir_ + "/out.bin";
  auto get = Cli({"get", "--namespace", ns, key + "=" + out});
  ASSERT_EQ(get.exit_code, 0) << get.output;
  EXPECT_TRUE(ReadFile(out) == payload);

  const std::string layer = dir_ + "/layer1.bin";
  auto get_layer = Cli({"get", "--namespace", ns, "--layers", "1:2", key + "=" + layer});
  ASSERT_EQ(get_layer.exit_code, 0) << get_layer.output;
  EXPECT_TRUE(ReadFile(layer) == payload.substr(1 << 20));

  auto stats = Cli({"stats"});
  ASSERT_EQ(stats.exit_code, 0) << stats.output;
  EXPECT_NE(stats.output.find("ram"), std::string::npos) << stats.output;
  EXPECT_NE(stats.output.find("ssd"), std::string::npos) << stats.output;
  EXPECT_NE(stats.output.find("write-back"), std::string::npos) << stats.output;

  auto del = Cli({"delete", "--namespace", ns, key});
  ASSERT_EQ(del.exit_code, 0) << del.output;
  auto missing = Cli({"get", "--namespace", ns, key + "=" + dir_ + "/gone.bin"});
  EXPECT_EQ(missing.exit_code, 1) << missing.output;
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/gone.bin"));
}

// `get` into a symlink replaces the file it names and keeps the link; into something
// that is not a regular file (a device here, /dev/stdout in use) it writes through it
// instead of renaming a file over it.
TEST_F(CliTest, GetFollowsSymlinksAndWritesThroughDevices) {
  const std::string ns = Register();
  const std::string key = testing::KeyOf(5).ToHex();
  const std::string payload = testing::PatternBytes(5, 2 << 20);
  auto put = Cli({"put", "--namespace", ns, key + "=" + WriteFile("chunk.bin", payload)});
  ASSERT_EQ(put.exit_code, 0) << put.output;

  const std::string target = WriteFile("target.bin", "old");
  const std::string link = dir_ + "/link.bin";
  ASSERT_EQ(symlink(target.c_str(), link.c_str()), 0);
  auto via_link = Cli({"get", "--namespace", ns, key + "=" + link});
  ASSERT_EQ(via_link.exit_code, 0) << via_link.output;
  EXPECT_TRUE(std::filesystem::is_symlink(link));
  EXPECT_TRUE(ReadFile(target) == payload);
  EXPECT_FALSE(std::filesystem::exists(link + ".partial"));

  // /dev/stdout redirected to a file (appending): both chunks arrive, after what was
  // there, instead of the file being replaced by the last one.
  const std::string log = WriteFile("appended.bin", "head");
  const std::string two = testing::KeyOf(6).ToHex();
  ASSERT_EQ(Cli({"put", "--namespace", ns, two + "=" + WriteFile("c6.bin", payload)}).exit_code, 0);
  const std::string cmd = absl::StrCat(KVTIER_CLI_PATH, " --target ", daemon_->target(),
                                       " get --namespace ", ns, " ", key, "=/dev/stdout ",
                                       two, "=/dev/stdout >> ", log);
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  EXPECT_TRUE(ReadFile(log) == "head" + payload + payload);

  if (geteuid() != 0) GTEST_SKIP() << "making a device node needs root";
  const std::string null = dir_ + "/null";
  ASSERT_EQ(mknod(null.c_str(), S_IFCHR | 0666, makedev(1, 3)), 0) << std::strerror(errno);
  auto into_device = Cli({"get", "--namespace", ns, key + "=" + null});
  ASSERT_EQ(into_device.exit_code, 0) << into_device.output;
  struct stat st {};
  ASSERT_EQ(stat(null.c_str(), &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode)) << "the device node was replaced";
  EXPECT_FALSE(std::filesystem::exists(null + ".partial"));
}

// A chunk that fails its CRC32C after some of its frames arrived leaves nothing of
// itself on stdout (which cannot be renamed into place like a file): those frames once
// went out as they came, and `>> file` kept them.
TEST_F(CliTest, AChunkFailingItsChecksumLeavesNothingOnStdout) {
  const std::string ns = Register();
  auto put = [&](uint64_t k) {
    const std::string file = WriteFile("in.bin", testing::PatternBytes(k, 2 << 20));
    auto r = Cli({"put", "--namespace", ns, testing::KeyOf(k).ToHex() + "=" + file});
    EXPECT_EQ(r.exit_code, 0) << r.output;
  };
  auto restart = [&](std::vector<std::string> args) {
    auto code = daemon_->Terminate();  // Write-back: flushed to SSD on the way out.
    ASSERT_TRUE(code.ok() && *code == 0);
    daemon_.reset();
    auto d = testing::DaemonProcess::Start(dir_ + "/data", std::move(args));
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_.emplace(*std::move(d));
  };
  put(5);
  ASSERT_NO_FATAL_FAILURE(restart({"--ram-capacity=64MiB"}));  // 5 alone in the first file.
  put(6);
  put(7);
  auto code = daemon_->Terminate();
  ASSERT_TRUE(code.ok() && *code == 0);
  daemon_.reset();
  // Bad bytes in chunk 5's second MiB (its second frame below); the file of 6 and 7
  // (twice the size) is left alone.
  ASSERT_EQ(testing::CorruptPayloadFiles(dir_ + "/data/ssd",
                                         [](uint64_t size) {
                                           std::vector<uint64_t> at;
                                           if (size < (3 << 20)) at.push_back(3 << 19);
                                           return at;
                                         }),
            2);
  // RAM full of pinned chunks: chunk 5 is streamed from SSD a frame at a time, each
  // checked as it is read, instead of being read whole into RAM first.
  auto d = testing::DaemonProcess::Start(
      dir_ + "/data", {"--ram-capacity=4MiB", "--max-pinned-fraction=1", "--max-frame-size=1MiB",
                       "--ssd-stream-buffer=1MiB"});
  ASSERT_TRUE(d.ok()) << d.status();
  daemon_.emplace(*std::move(d));
  auto pin = Cli({"pin", "--namespace", ns, testing::KeyOf(6).ToHex(), testing::KeyOf(7).ToHex()});
  ASSERT_EQ(pin.exit_code, 0) << pin.output;

  const std::string out = WriteFile("stdout.bin", "");
  const std::string cmd = absl::StrCat(KVTIER_CLI_PATH, " --target ", daemon_->target(),
                                       " get --namespace ", ns, " ", testing::KeyOf(5).ToHex(),
                                       "=/dev/stdout > ", out, " 2>/dev/null");
  const int status = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(status)) << cmd;
  EXPECT_EQ(WEXITSTATUS(status), 1) << cmd;
  EXPECT_EQ(ReadFile(out).size(), 0u) << "part of a chunk that failed its checksum";
}

// A put from a process that did not register the layout (the CLI's always) learns the
// daemon's frame limit (DataPlane) and fits its frames to it. It once sent 2 MiB frames
// to a daemon taking 1 MiB ones and was refused.
TEST_F(CliTest, APutLearnsTheDaemonsFrameLimit) {
  const std::string ns = Register();
  auto code = daemon_->Terminate();
  ASSERT_TRUE(code.ok() && *code == 0);
  daemon_.reset();
  auto d = testing::DaemonProcess::Start(dir_ + "/data",
                                         {"--ram-capacity=64MiB", "--max-frame-size=1MiB"});
  ASSERT_TRUE(d.ok()) << d.status();
  daemon_.emplace(*std::move(d));
  const std::string key = testing::KeyOf(8).ToHex();
  const std::string payload = testing::PatternBytes(8, 2 << 20);
  auto put = Cli({"put", "--namespace", ns, key + "=" + WriteFile("in.bin", payload)});
  ASSERT_EQ(put.exit_code, 0) << put.output;
  auto get = Cli({"get", "--namespace", ns, key + "=" + dir_ + "/out.bin"});
  ASSERT_EQ(get.exit_code, 0) << get.output;
  EXPECT_TRUE(ReadFile(dir_ + "/out.bin") == payload);
}

TEST_F(CliTest, ErrorsAreClearAndExitNonZero) {
  const std::string ns = Register();
  const std::string key = testing::KeyOf(1).ToHex();
  const std::string small = WriteFile("small.bin", std::string(1000, 'x'));
  auto wrong_size = Cli({"put", "--namespace", ns, key + "=" + small});
  EXPECT_EQ(wrong_size.exit_code, 1) << wrong_size.output;

  auto unknown_ns = Cli({"lookup", "--namespace", "00000000000000ab", key});
  EXPECT_EQ(unknown_ns.exit_code, 1) << unknown_ns.output;
  EXPECT_NE(unknown_ns.output.find("NOT_FOUND"), std::string::npos) << unknown_ns.output;

  auto bad_key = Cli({"lookup", "--namespace", ns, "nothex"});
  EXPECT_EQ(bad_key.exit_code, 2) << bad_key.output;

  auto usage = Cli({"frobnicate"});
  EXPECT_EQ(usage.exit_code, 2) << usage.output;
}

// Two keys with one OUTFILE: each chunk was renamed onto it in turn, so the file held
// the second and the report said both were got. A usage error now, however the two
// names spell the file; devices and FIFOs, written in place, still take several.
TEST_F(CliTest, GetRefusesOneOutputFileForTwoKeys) {
  const std::string ns = Register();
  const std::string a = testing::KeyOf(11).ToHex(), b = testing::KeyOf(12).ToHex();
  ASSERT_EQ(Cli({"put", "--namespace", ns,
                 a + "=" + WriteFile("a.bin", testing::PatternBytes(11, 2 << 20)),
                 b + "=" + WriteFile("b.bin", testing::PatternBytes(12, 2 << 20))})
                .exit_code,
            0);
  const std::string out = dir_ + "/out.bin";
  ASSERT_EQ(::symlink(out.c_str(), (dir_ + "/link.bin").c_str()), 0) << std::strerror(errno);
  for (const std::string& again : {out, dir_ + "/./out.bin", dir_ + "/link.bin"}) {
    auto dup = Cli({"get", "--namespace", ns, a + "=" + out, b + "=" + again});
    EXPECT_EQ(dup.exit_code, 2) << again << ": " << dup.output;
    EXPECT_NE(dup.output.find("one file holds one chunk"), std::string::npos) << dup.output;
    EXPECT_FALSE(std::filesystem::exists(out)) << again;
  }
  auto in_place = Cli({"get", "--namespace", ns, a + "=/dev/null", b + "=/dev/null"});
  EXPECT_EQ(in_place.exit_code, 0) << in_place.output;
}

TEST_F(CliTest, KeysMatchTheKeyScheme) {
  const std::string ns = Register();
  std::string tokens;
  std::vector<uint32_t> ids;
  for (uint32_t t = 0; t < 600; ++t) {
    ids.push_back(t * 7 + 1);
    tokens += std::to_string(t * 7 + 1) + " ";
  }
  const std::string file = WriteFile("tokens.txt", tokens);
  auto r = RunCommand({KVTIER_CLI_PATH, "keys", "--namespace", ns, "--tokens-per-chunk", "256",
                       "--tokens-file", file});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  uint64_t ns_id = std::stoull(ns, nullptr, 16);
  auto keys = ComputeChunkKeys(ns_id, ids, 256);
  ASSERT_EQ(keys.size(), 2u);  // 600 tokens: two full chunks, the rest is not cached.
  EXPECT_NE(r.output.find(keys[0].ToHex()), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(keys[1].ToHex()), std::string::npos) << r.output;
}

// A command's stdout is its result: output that could not all be written (here to a full
// device) fails the command, where it once exited 0 with a truncated key list.
TEST_F(CliTest, OutputThatCannotBeWrittenFailsTheCommand) {
  const std::string ns = Register();
  const std::string key = testing::KeyOf(1).ToHex();
  const std::string cli = KVTIER_CLI_PATH;
  for (const std::string& command :
       {cli + " --help", cli + " --target " + daemon_->target() + " lookup --namespace " + ns +
                             " " + key,
        cli + " --target " + daemon_->target() + " stats"}) {
    auto full = RunCommand({"/bin/sh", "-c", command + " > /dev/full"});
    EXPECT_EQ(full.exit_code, 1) << command << "\n" << full.output;
    EXPECT_NE(full.output.find("writing to standard output failed"), std::string::npos)
        << full.output;
    auto fine = RunCommand({"/bin/sh", "-c", command + " > /dev/null"});
    EXPECT_EQ(fine.exit_code, 0) << command << "\n" << fine.output;
  }
}

}  // namespace
}  // namespace kvtier
