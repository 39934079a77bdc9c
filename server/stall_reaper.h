// StallReaper: ends calls whose client has gone quiet (option client_idle_timeout). A
// Put stream that stops sending mid-chunk holds pool slots, a Get or Prefill whose client
// stops reading holds the chunks it is sending (and each holds a place among
// max_streams; a Prefill, a thread) until its deadline, which may be hours away or
// never; the reaper cancels any watched call that has been waiting on its client for
// longer than `idle`, and the call's own cancellation path gives everything back. A call
// is idle only while it waits for the client (a read pending, or a write the client's
// flow-control window holds back), never while the daemon is working for it (waiting
// for room, reading SSD, committing): those waits have their own deadlines.
//
// A place that others wait for is reclaimed sooner: a call watched as holding a
// contended place (a Put stream's place within max_put_buffer) is cancelled once it has
// waited on its client for `contended_idle`, but only while others wait in line for such
// a place, and no more of them than wait (the longest idle first; those cancelled and
// not yet gone count as places on their way). A stalled client then costs the line
// `contended_idle`, not client_idle_timeout. The daemon sees frames, not bytes: a frame
// still arriving looks quiet. So the bound is also at least kSlowFrameFactor times the
// recent time between frames of contendable calls (a moving average): where a slow link
// makes every stream slow, healthy ones are not taken for stalled. Only frames of at
// least a quarter of full_frame_bytes feed that average (a small frame arriving slowly
// is what a stalling client sends, not evidence of a slow link), and the bound is at
// most kMaxBoundFactor times contended_idle: clients that hold every place cannot raise
// it without end by sending frames just inside it.
//
// Thread-safety: thread-safe. `cancel` runs on the reaper's thread under its lock, so
// Unwatch (which takes the lock) never returns while it runs: after Unwatch the call
// may be destroyed.
#ifndef KVTIER_SERVER_STALL_REAPER_H_
#define KVTIER_SERVER_STALL_REAPER_H_

#include <cstdint>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "prometheus/counter.h"
#include "prometheus/registry.h"
#include "storage/steady_now.h"

namespace kvtier {

struct StallReaperOptions {
  absl::Duration idle = absl::Seconds(60);  // Zero: reap nothing on this bound.
  // The bound for calls holding a contended place while `waiting_for_place()` calls wait
  // for one (asked once per sweep, with the reaper's lock held: it must not call into the
  // reaper). Zero: off.
  absl::Duration contended_idle = absl::ZeroDuration();
  std::function<uint32_t()> waiting_for_place;
  // A full frame's payload (the daemon's max_frame_size): smaller frames than a quarter
  // of it do not feed the moving average of frame gaps.
  uint64_t full_frame_bytes = 4ull << 20;
  absl::Duration period = absl::Seconds(1);  // How often the thread sweeps.
  bool run_thread = true;  // False: only Sweep() (tests, with a fake clock).
  std::function<absl::Time()> clock = SteadyNow;  // Monotonic (see SteadyNow).
  // Where kvtier_client_stalls_cancelled_total and kvtier_put_places_reclaimed_total go;
  // may be null.
  prometheus::Registry* registry = nullptr;
};

class StallReaper {
 public:
  explicit StallReaper(StallReaperOptions options);
  ~StallReaper();
  StallReaper(const StallReaper&) = delete;
  StallReaper& operator=(const StallReaper&) = delete;

  // Starts watching a call; `cancel` ends it (for example ServerContext::TryCancel).
  // `contendable`: it holds a place others may wait for (contended_idle applies).
  // Returns a handle for the calls below; 0 when reaping is off.
  uint64_t Watch(std::function<void()> cancel, bool contendable = false);
  // The call now waits for its client (true) or for the daemon (false); when a frame
  // ended the wait, `frame_bytes` is its size.
  void SetWaitingOnClient(uint64_t handle, bool waiting, uint64_t frame_bytes = 0);
  void Unwatch(uint64_t handle);

  // Cancels every call that has waited on its client for longer than `idle` (or than
  // `contended_idle`, see above); each is cancelled once. Returns how many it cancelled.
  int Sweep();
  uint64_t reaped() const;
  uint64_t reclaimed() const;  // Of those, cancelled by contended_idle alone.
  // The bound on a contended place's quiet time now: contended_idle, or kSlowFrameFactor
  // times the recent gap between frames if that is longer, but at most kMaxBoundFactor
  // times contended_idle.
  absl::Duration ContendedBound() const;

  static constexpr int kSlowFrameFactor = 4;
  static constexpr int kFrameGapWeight = 16;  // The average's weight: 1/16 per frame.
  static constexpr int kMaxBoundFactor = 8;

  // One watched call, for as long as this lives (or until Reset): the RAII form of
  // Watch/SetWaitingOnClient/Unwatch. Default-constructed, or with a null reaper, it
  // watches nothing. Reset (or destroy) it before the call's context goes.
  class Watched {
   public:
    Watched() = default;
    Watched(StallReaper* reaper, std::function<void()> cancel, bool contendable = false);
    ~Watched() { Reset(); }
    Watched(Watched&& other) noexcept;
    Watched& operator=(Watched&& other) noexcept;

    void WaitingOnClient(bool waiting, uint64_t frame_bytes = 0) const;
    void Reset();

   private:
    StallReaper* reaper_ = nullptr;
    uint64_t handle_ = 0;
  };

 private:
  struct Entry {
    std::function<void()> cancel;
    bool contendable = false;
    bool waiting = false;
    bool cancelled = false;
    absl::Time since;
  };
  bool Reaps() const;  // Either bound is on.
  absl::Duration ContendedBoundLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Loop();

  const StallReaperOptions options_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, Entry> calls_ ABSL_GUARDED_BY(mu_);
  uint64_t next_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t reaped_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t reclaimed_ ABSL_GUARDED_BY(mu_) = 0;
  // Moving average of how long contendable calls waited for each frame; zero: none yet.
  absl::Duration frame_gap_ ABSL_GUARDED_BY(mu_) = absl::ZeroDuration();
  prometheus::Counter* reaped_metric_ = nullptr;
  prometheus::Counter* reclaimed_metric_ = nullptr;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_STALL_REAPER_H_
