// Test helpers shared by the storage tests: a clock that moves only when told, and a
// temporary directory removed with everything in it.
#ifndef KVTIER_TESTS_SUPPORT_FAKE_CLOCK_H_
#define KVTIER_TESTS_SUPPORT_FAKE_CLOCK_H_

#include <stdlib.h>

#include <filesystem>
#include <functional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace kvtier::testing {

class FakeClock {
 public:
  absl::Time Now() const {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    now_ += d;
  }
  // For options that take a clock; this object must outlive the function.
  std::function<absl::Time()> AsFunction() {
    return [this] { return Now(); };
  }

 private:
  mutable absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_) = absl::FromUnixSeconds(1700000000);
};

// A fresh directory under the test temp dir, removed with everything in it.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "kvtier") {
    std::string tmpl = ::testing::TempDir() + prefix + "_XXXXXX";
    if (mkdtemp(tmpl.data()) == nullptr) ADD_FAILURE() << "mkdtemp failed: " << tmpl;
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_SUPPORT_FAKE_CLOCK_H_
