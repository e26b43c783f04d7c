// parallel_for over the calling thread's own OpenMP team, for every module of csrc/.
//
// NOTE: not at::parallel_for. Its first call on a thread runs at::init_num_threads through a thread-local flag that
// each shared object keeps a copy of, and that sets the calling thread's team to the process-wide count torch was
// last given: a device thread set to `torch_threads: 1` stepped on every core after its first call into one of
// these modules (a caller restoring its own count after starting the thread is enough). at::get_num_threads,
// defined in libtorch, is the thread's count as torch's own ops see it.
#pragma once

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>

namespace tokenrouter {

// f(b, e) over [begin, end) in one contiguous range per thread, as at::parallel_for splits it: no more threads
// than ranges of `grain`, and serially inside a parallel region.
template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  const int64_t n = end - begin, ranges = (n + std::max<int64_t>(grain, 1) - 1) / std::max<int64_t>(grain, 1);
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), ranges));
  if (threads <= 1 || omp_in_parallel()) {
    f(begin, end);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    const int64_t per = (n + threads - 1) / threads, b = begin + omp_get_thread_num() * per;
    if (b < end) f(b, std::min(end, b + per));
  }
}

}  // namespace tokenrouter
