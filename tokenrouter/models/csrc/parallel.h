// parallel_for over the calling thread's own OpenMP team, and the int4 / int8 kernels' passes over groups of weight
// rows (over_groups), for every module of csrc/.
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
#include <type_traits>

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

template <int MB, typename Group>
inline void rows_of(const Group& group, int64_t g, int64_t m) { group(g, m, std::integral_constant<int, MB>{}); }

// Each group of weight rows (four or sixteen, as a kernel packs them) once, all rows of x over it in passes of at
// most MAX rows, split evenly (MAX 6, 16 rows: 5, 5, 6; 7 rows: 3, 4).
template <int MAX, typename Group>
inline void over_groups(int64_t G, int64_t M, const Group& group) {
  static_assert(MAX >= 1 && MAX <= 6, "MAX: 1-6 rows a pass");
  const int64_t passes = (M + MAX - 1) / MAX;
  tokenrouter::parallel_for(0, G, 8, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t p = 0, m = 0; p < passes; ++p) {
        const int64_t rows = (M - m) / (passes - p);
        switch (rows) {
          case 1: rows_of<1>(group, g, m); break;
          case 2: rows_of<MAX >= 2 ? 2 : 1>(group, g, m); break;
          case 3: rows_of<MAX >= 3 ? 3 : 1>(group, g, m); break;
          case 4: rows_of<MAX >= 4 ? 4 : 1>(group, g, m); break;
          case 5: rows_of<MAX >= 5 ? 5 : 1>(group, g, m); break;
          default: rows_of<MAX >= 6 ? 6 : 1>(group, g, m); break;
        }
        m += rows;
      }
    }
  });
}

}  // namespace tokenrouter
