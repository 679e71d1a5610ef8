// Helper threads of the kernels' own, kept hot between the calls of a step. Included by cpu_kernels.cc.
//
// A decode step makes ~150 kernel calls of 40-300 us each, with a few microseconds of XLA's own work
// between them. Helpers handed to XLA's intra-op pool for every call start late (a pool thread wakes
// from sleep) or share the second core with the pool's other threads, so a call's second core did
// ~half its share: in a decode step at batch 16 on a 2-core Zen 4, the products took 267 / 175 / 133 /
// 66 us per call (gate/up, down, QKV, O) against 203 / 98 / 62 / 38 us for the same code on two threads
// of their own. Here each helper waits for the next call spinning for a while (`kSpinNs`), then sleeps;
// the caller wakes sleepers only when there are any.
//
// One call at a time uses the team (`run` returns false while another holds it: that caller splits its
// work as before). A call's chunks are claimed from a counter by the caller and the helpers; the caller
// returns once every claimed chunk is done. A helper that arrives after that finds nothing to claim and
// never touches the finished call's body: the next call waits until no helper is inside the last one
// before it rewrites the shared state (an odd epoch marks it being rewritten).
#pragma once

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace team {

constexpr int64_t kSpinNs = 100000;  // a helper spins this long after its last call before it sleeps

class Team {
 public:
  explicit Team(int helpers) {
    for (int i = 0; i < helpers; ++i)
      threads_.emplace_back([this] {
        pthread_setname_np(pthread_self(), "parrot-team");  // as `top -H` and /proc/<pid>/task/*/comm show it
        helper();
      });
    for (auto& t : threads_) t.detach();  // they live as long as the process
  }

  // Runs body(c) for c in [0, chunks) on the caller and the helpers; false (nothing run) if the team is busy.
  template <typename F>
  bool run(int64_t chunks, F& body) {
    std::unique_lock<std::mutex> own(owner_, std::try_to_lock);
    if (!own.owns_lock()) return false;
    const uint64_t e = epoch_.load(std::memory_order_relaxed);
    epoch_.store(e + 1, std::memory_order_seq_cst);  // odd: being rewritten, helpers keep out
    while (inside_.load(std::memory_order_seq_cst) != 0) _mm_pause();
    ctx_ = &body;
    call_ = [](void* ctx, int64_t c) { (*static_cast<F*>(ctx))(c); };
    chunks_ = chunks;
    next_.store(0, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    epoch_.store(e + 2, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lk(sleep_);
      wake_.notify_all();
    }
    work();
    while (done_.load(std::memory_order_acquire) < chunks) _mm_pause();
    return true;
  }

 private:
  void work() {
    for (;;) {
      const int64_t c = next_.fetch_add(1, std::memory_order_relaxed);
      if (c >= chunks_) return;
      call_(ctx_, c);
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void helper() {
    uint64_t seen = 0;
    for (;;) {
      wait_for_new(seen);
      inside_.fetch_add(1, std::memory_order_seq_cst);
      const uint64_t e = epoch_.load(std::memory_order_seq_cst);
      if (e % 2 == 0 && e != seen) {  // a call whose state is set (and stays so while we are inside)
        work();
        seen = e;
      }
      inside_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  void wait_for_new(uint64_t seen) {
    auto fresh = [&] { const uint64_t e = epoch_.load(std::memory_order_acquire); return e % 2 == 0 && e != seen; };
    const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(kSpinNs);
    for (int i = 0;; ++i) {
      if (fresh()) return;
      _mm_pause();
      if ((i & 255) == 255) {
        if (std::chrono::steady_clock::now() > until) break;
        sched_yield();  // let a thread that needs this core have it
      }
    }
    std::unique_lock<std::mutex> lk(sleep_);
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    wake_.wait(lk, [&] {
      const uint64_t e = epoch_.load(std::memory_order_seq_cst);
      return e % 2 == 0 && e != seen;
    });
    sleepers_.fetch_sub(1, std::memory_order_seq_cst);
  }

  std::vector<std::thread> threads_;
  std::mutex owner_;                 // held by the call using the team
  std::atomic<uint64_t> epoch_{0};   // even: a call's state is set; odd: being rewritten
  std::atomic<int> inside_{0};       // helpers that may be reading the call's state
  std::atomic<int64_t> next_{0}, done_{0};
  int64_t chunks_ = 0;
  void* ctx_ = nullptr;
  void (*call_)(void*, int64_t) = nullptr;
  std::mutex sleep_;
  std::condition_variable wake_;
  std::atomic<int> sleepers_{0};
};

// The process's team, `helpers` threads, created on first use; none in a child forked after that (its
// threads did not survive the fork), so the child's calls split their work the other way.
inline std::atomic<Team*>& slot() {
  static std::atomic<Team*> team{nullptr};
  return team;
}

inline std::atomic<bool>& forked() {
  static std::atomic<bool> f{false};
  return f;
}

inline Team* get(int helpers) {
  if (helpers < 1 || forked().load(std::memory_order_relaxed)) return nullptr;
  Team* t = slot().load(std::memory_order_acquire);
  if (t != nullptr) return t;
  static std::mutex make;
  std::lock_guard<std::mutex> lk(make);
  t = slot().load(std::memory_order_acquire);
  if (t == nullptr) {
    static std::once_flag at_fork;
    std::call_once(at_fork, [] { pthread_atfork(nullptr, nullptr, [] { forked().store(true); }); });
    t = new Team(helpers);
    slot().store(t, std::memory_order_release);
  }
  return t;
}

}  // namespace team
