// A thread pool for the kernels' parallel loops that never waits for a thread that has not started.
//
// OpenMP (at::parallel_for) ends every parallel region at a barrier that waits for every thread of the
// team. On a machine where another process holds a core, the descheduled thread arrives a scheduler time
// slice later, and a decode step of a few hundred regions pays that wait each time, many times its quiet time
// (docs/benchmarks-history.md). Here the calling thread and the workers
// claim chunks of the loop one at a time from a shared counter: whoever runs does the work, and the caller
// waits only for chunks that another thread has claimed and not yet finished. A worker that wakes up late
// finds nothing left to claim.
//
// Workers spin briefly between loops (a decode step's Python between two kernels takes tens of
// microseconds), then sleep on a futex (std::atomic::wait), so an idle engine burns no CPU.
//
// A worker descheduled while it holds a chunk still costs the caller a wait of about one time slice. A wait
// past kStallMicros and four times what one chunk took the caller is such a stall. Beside a busy process
// stalls come every few milliseconds; a quiet VM has a few a second, now and then two close together
// (docs/benchmarks-history.md). kStallStreak stalls each within kStallGapMillis of the last say that another
// process holds a core: the caller then runs every loop alone for ITERSERVE_POOL_SOLO_MS (default 200; 0
// turns this off), twice as long each time the contention is back within kRetryMillis of the last stretch
// (up to kSoloMaxMillis), before trying the workers again. Alone, the caller and the other process each keep
// a core, where two threads of ours sharing one stall each other at every loop.

#pragma once

#include <ATen/Parallel.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstdint>
#include <thread>

namespace iterserve {

class ChunkPool {
 public:
  using Fn = void (*)(void* ctx, int64_t chunk);

  // The process's pool, sized to torch's intra-op thread count when first used (resize() changes it). Never
  // destroyed: its workers end with the process (and a forked child, which has none, runs every chunk itself).
  static ChunkPool& get() {
    static ChunkPool* pool = new ChunkPool(std::max<int>(1, at::get_num_threads()));
    return *pool;
  }

  int threads() const { return limit_.load(std::memory_order_relaxed) + 1; }

  // The times so far that the caller went on alone for a while (see the top of this file).
  int64_t solos() const { return solos_.load(std::memory_order_relaxed); }

  // Use `threads` threads (the caller included) from the next loop on; workers beyond that sleep.
  void resize(int threads) {
    const int workers = std::max(0, threads - 1);
    while (spawned_ < workers) {
      const int index = spawned_++;
      std::thread([this, index] { work(index); }).detach();
    }
    limit_.store(workers, std::memory_order_release);
    limit_.notify_all();
  }

  // fn(ctx, c) for every c in [0, n), on this thread and whichever workers are running.
  void run(int64_t n, Fn fn, void* ctx) {
    bool idle = false;
    if (n <= 1 || limit_.load(std::memory_order_relaxed) == 0 ||
        Clock::now() < solo_until_.load(std::memory_order_relaxed) || !active_.compare_exchange_strong(idle, true)) {
      for (int64_t c = 0; c < n; ++c) fn(ctx, c);  // one chunk, no workers, alone for a while, or nested use
      return;
    }
    fn_.store(fn, std::memory_order_relaxed);
    ctx_.store(ctx, std::memory_order_relaxed);
    n_.store(n, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    const uint64_t gen = (ticket_.load(std::memory_order_relaxed) >> 32) + 1;
    ticket_.store(gen << 32, std::memory_order_seq_cst);  // publishes the job
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      wake_.fetch_add(1, std::memory_order_release);
      wake_.notify_all();
    }
    const auto begin = Clock::now();
    int64_t mine = 0;
    for (int64_t c; (c = claim(gen, n)) >= 0; ++mine) fn(ctx, c);
    // Only chunks claimed by a running worker are left: wait for them to finish.
    const int64_t target = n - mine;
    if (done_.load(std::memory_order_acquire) < target) {
      const auto start = Clock::now();
      while (done_.load(std::memory_order_acquire) < target) std::this_thread::yield();
      const auto end = Clock::now();
      // A stall: far longer than a quiet wake, and than the chunks took this thread (a large chunk is no stall).
      const auto per_chunk = (start - begin) / std::max<int64_t>(1, mine);
      if (end - start > std::chrono::microseconds(kStallMicros) && end - start > 4 * per_chunk) {
        streak_ = end - last_stall_ < std::chrono::milliseconds(kStallGapMillis) ? streak_ + 1 : 1;
        last_stall_ = end;
        if (solo_ms_ > 0 && streak_ >= kStallStreak) {
          // Contention back right after the last stretch alone: stay alone twice as long, up to kSoloMaxMillis.
          const auto last_end = solo_until_.load(std::memory_order_relaxed);
          solo_len_ = end - last_end < std::chrono::milliseconds(kRetryMillis)
                          ? std::min(2 * solo_len_, std::chrono::milliseconds(kSoloMaxMillis))
                          : std::chrono::milliseconds(solo_ms_);
          solo_until_.store(end + solo_len_, std::memory_order_relaxed);
          solos_.fetch_add(1, std::memory_order_relaxed);
          streak_ = 0;
        }
      }
    }
    active_.store(false, std::memory_order_release);
  }

 private:
  explicit ChunkPool(int threads) : solo_ms_(env_int("ITERSERVE_POOL_SOLO_MS", 200)) { resize(threads); }

  static int env_int(const char* name, int fallback) {
    const char* v = std::getenv(name);
    return v != nullptr && *v != '\0' ? std::atoi(v) : fallback;
  }

  // The next unclaimed chunk of job `gen`, or -1 once none is left (or the job is over).
  int64_t claim(uint64_t gen, int64_t n) {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    while ((t >> 32) == gen && static_cast<int64_t>(t & 0xffffffffu) < n) {
      if (ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) return static_cast<int64_t>(t & 0xffffffffu);
    }
    return -1;
  }

  void work(int index) {
    uint64_t seen = 0;  // the last job this worker looked at
    while (true) {
      const int limit = limit_.load(std::memory_order_acquire);
      if (index >= limit) {  // not part of the pool at its current size: sleep until it grows
        limit_.wait(limit, std::memory_order_acquire);
        continue;
      }
      uint64_t t = ticket_.load(std::memory_order_acquire);
      if ((t >> 32) == seen) {
        wait_for_job(seen);
        continue;
      }
      seen = t >> 32;
      Fn fn = fn_.load(std::memory_order_relaxed);
      void* ctx = ctx_.load(std::memory_order_relaxed);
      const int64_t n = n_.load(std::memory_order_relaxed);
      for (int64_t c; (c = claim(seen, n)) >= 0;) {
        fn(ctx, c);
        done_.fetch_add(1, std::memory_order_acq_rel);
      }
    }
  }

  // Spin a while for the next job, then sleep until the caller wakes the pool.
  void wait_for_job(uint64_t seen) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
    while (std::chrono::steady_clock::now() < until) {
      for (int i = 0; i < 64; ++i) {
        if ((ticket_.load(std::memory_order_acquire) >> 32) != seen) return;
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
      }
    }
    const uint32_t w = wake_.load(std::memory_order_acquire);
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    if ((ticket_.load(std::memory_order_seq_cst) >> 32) == seen) wake_.wait(w, std::memory_order_acquire);
    sleepers_.fetch_sub(1, std::memory_order_seq_cst);
  }

  using Clock = std::chrono::steady_clock;

  // Long enough to bridge the Python between two kernels of a step, short enough to free the core soon.
  static constexpr int kSpinMicros = 200;
  static constexpr int kStallMicros = 1000;
  static constexpr int kStallGapMillis = 20;
  static constexpr int kStallStreak = 4;
  static constexpr int kRetryMillis = 100;
  static constexpr int kSoloMaxMillis = 1600;
  const int solo_ms_;
  std::atomic<Clock::time_point> solo_until_{};
  // Written by the caller only (one job at a time).
  Clock::time_point last_stall_{};
  int streak_ = 0;
  std::chrono::milliseconds solo_len_{0};
  std::atomic<int64_t> solos_{0};

  int spawned_ = 0;                 // worker threads started (resize() is called with the GIL held)
  std::atomic<int> limit_{0};       // of which the first limit_ take part
  std::atomic<uint64_t> ticket_{0};  // job generation << 32 | next unclaimed chunk
  std::atomic<Fn> fn_{nullptr};
  std::atomic<void*> ctx_{nullptr};
  std::atomic<int64_t> n_{0};
  std::atomic<int64_t> done_{0};  // chunks finished by workers
  std::atomic<uint32_t> wake_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> active_{false};
};

// f(begin, end) over [0, n) in chunks of `grain`, on the pool.
template <typename F>
void parallel_chunks(int64_t n, int64_t grain, const F& f) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  struct Ctx {
    const F* f;
    int64_t n, grain;
  } ctx{&f, n, grain};
  const int64_t chunks = (n + grain - 1) / grain;
  ChunkPool::get().run(chunks, [](void* p, int64_t c) {
    auto* x = static_cast<Ctx*>(p);
    const int64_t b = c * x->grain;
    (*x->f)(b, std::min(x->n, b + x->grain));
  }, &ctx);
}

}  // namespace iterserve
