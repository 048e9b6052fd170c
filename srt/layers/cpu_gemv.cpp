// gramsync::small_linear(x [M, K], wp) -> x @ w.T [M, N]: the decode step's matmuls at a few
// rows (M <= 16), where a step is a weight read. wp is w [N, K] packed in 16-row panels
// (cpu_gemv.py: bf16 [N/16, K/2, 16, 2], vdpbf16ps's pair layout; fp32 [N/16, K, 16]), so
// each panel is one contiguous stream read once. A register tile of MB rows of x by NBT
// panels keeps MB x NBT accumulators of 16 outputs; each 64-byte load of a panel feeds MB
// multiply-adds against a broadcast of x: no horizontal sums, and a panel is never re-read
// however many rows (up to 16) the batch has. fp32 accumulation, one rounding to the output
// dtype, as oneDNN does. bf16 needs AVX512-BF16, fp32 AVX512F (cpu_gemv.cpu_runs: the graphs
// use it only there). Why a hand kernel: oneDNN's packed bf16 GEMM reads ~36-40 GB/s at one
// row where this reads at the machine's read rate (docs/speed.md, "A GEMV for the small
// batches").
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>
#include <immintrin.h>

namespace {

constexpr int kPanel = 16;  // outputs per panel (one zmm of fp32)
constexpr int kMaxTileRows = 16;
// Software prefetch distance into each panel's stream, by rows in the tile. At 1-2 rows the
// hardware prefetcher keeps up (prefetching slowed the read); from 4 rows the multiply-adds
// per byte grow and the stream falls behind without it (SmolLM2's 121 matmuls, bf16, 16 rows:
// 12.9 ms without, 8.1 at 2 KB ahead, 6.5 at 4 KB; oneDNN 9.1-9.3 in the same runs).
constexpr int prefetch_bytes(int mb) { return mb >= 8 ? 4096 : mb >= 4 ? 2048 : 0; }

bool has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
}
bool has_avx512_bf16() { return has_avx512() && __builtin_cpu_supports("avx512bf16"); }

bool has_avx2_fma() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

const bool kAvx512 = has_avx512();
const bool kAvx512Bf16 = has_avx512_bf16();
const bool kAvx2 = has_avx2_fma();

// Panels per register tile for MB rows: MB x NBT accumulators (<= 16 of 32 registers).
constexpr int panels_for(int mb) { return mb <= 2 ? 8 : mb <= 4 ? 4 : mb <= 8 ? 2 : 1; }

// y[m, p*16 + i] for MB rows and NBT panels starting at panel p0.
template <int MB, int NBT>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void tile_bf16(
    const uint16_t* x, int64_t K, const uint16_t* wp, int64_t p0, c10::BFloat16* y, int64_t ldy) {
  constexpr int kPrefetchBytes = prefetch_bytes(MB);
  __m512 acc[MB][NBT];
  for (int m = 0; m < MB; m++)
    for (int p = 0; p < NBT; p++) acc[m][p] = _mm512_setzero_ps();
  const int64_t panel_elems = K * kPanel;  // K/2 pairs x 16 outputs x 2
  const uint16_t* w = wp + p0 * panel_elems;
  for (int64_t k2 = 0; k2 < K / 2; k2++) {
    __m512bh wv[NBT];
    for (int p = 0; p < NBT; p++) {
      const uint16_t* at = w + p * panel_elems + k2 * 32;
      if (kPrefetchBytes) _mm_prefetch(reinterpret_cast<const char*>(at) + kPrefetchBytes, _MM_HINT_T0);
      wv[p] = (__m512bh)_mm512_loadu_si512(at);
    }
    for (int m = 0; m < MB; m++) {
      int32_t pair;
      __builtin_memcpy(&pair, x + m * K + 2 * k2, 4);
      __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int p = 0; p < NBT; p++) acc[m][p] = _mm512_dpbf16_ps(acc[m][p], wv[p], xv);
    }
  }
  for (int m = 0; m < MB; m++)
    for (int p = 0; p < NBT; p++)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * ldy + (p0 + p) * kPanel),
                          (__m256i)_mm512_cvtneps_pbh(acc[m][p]));  // nearest even
}

template <int MB, int NBT>
__attribute__((target("avx512f"))) void tile_f32(
    const float* x, int64_t K, const float* wp, int64_t p0, float* y, int64_t ldy) {
  constexpr int kPrefetchBytes = prefetch_bytes(MB);
  __m512 acc[MB][NBT];
  for (int m = 0; m < MB; m++)
    for (int p = 0; p < NBT; p++) acc[m][p] = _mm512_setzero_ps();
  const int64_t panel_elems = K * kPanel;
  const float* w = wp + p0 * panel_elems;
  for (int64_t k = 0; k < K; k++) {
    __m512 wv[NBT];
    for (int p = 0; p < NBT; p++) {
      const float* at = w + p * panel_elems + k * kPanel;
      if (kPrefetchBytes) _mm_prefetch(reinterpret_cast<const char*>(at) + kPrefetchBytes, _MM_HINT_T0);
      wv[p] = _mm512_loadu_ps(at);
    }
    for (int m = 0; m < MB; m++) {
      __m512 xv = _mm512_set1_ps(x[m * K + k]);
      for (int p = 0; p < NBT; p++) acc[m][p] = _mm512_fmadd_ps(wv[p], xv, acc[m][p]);
    }
  }
  for (int m = 0; m < MB; m++)
    for (int p = 0; p < NBT; p++) _mm512_storeu_ps(y + m * ldy + (p0 + p) * kPanel, acc[m][p]);
}

// AVX2 + FMA (no AVX512): a panel's 16 outputs are two ymm accumulators, and 16 ymm
// registers hold MB x NBT x 2 accumulators, the NBT x 2 weight vectors and x's broadcast,
// so at most 6 rows share a load. Larger batches go in row groups that take each panel in
// turn, a chunk of kChunk columns at a time (8 KB, in L1), the accumulators kept in y
// between chunks: the weights then stream from memory at an even pace under the groups'
// multiply-adds, where whole-panel groups would leave memory idle during the later groups.
constexpr int kAvx2MaxRows = 6;
constexpr int64_t kChunk = 128;
constexpr int avx2_panels_for(int mb) { return mb == 1 ? 4 : mb <= 3 ? 2 : 1; }
// One core's stream falls behind its multiply-adds from 3 rows (one core reads ~10 GB/s here,
// and 6 rows compute ~24 GB/s worth): 4 KB ahead read 6.3-6.8 -> 8.2-8.8 GB/s at 4 rows and
// 5.6-7.2 -> 8.0-9.1 at 3 in a one-core stream test; at one row it slowed the read.
constexpr int avx2_prefetch_bytes(int mb) { return mb >= 3 ? 4096 : 0; }

// y[m, p*16 + i] (+)= x[m, k0:k1] . panel rows, for MB rows and NBT panels from p0.
template <int MB, int NBT>
__attribute__((target("avx2,fma"))) void tile_f32_avx2(const float* x, int64_t ldx, int64_t K, int64_t k0,
                                                       int64_t k1, const float* wp, int64_t p0, float* y,
                                                       int64_t ldy, bool accumulate) {
  // Flat arrays: GCC keeps a [MB][NBT][2] array of vectors on the stack, storing it every step.
  constexpr int V = 2 * NBT;
  __m256 acc[MB * V];
  for (int m = 0; m < MB; m++)
    for (int v = 0; v < V; v++)
      acc[m * V + v] = accumulate ? _mm256_loadu_ps(y + m * ldy + p0 * kPanel + v * 8) : _mm256_setzero_ps();
  const int64_t panel_elems = K * kPanel;
  const float* w = wp + p0 * panel_elems;
  for (int64_t k = k0; k < k1; k++) {
    __m256 wv[V];
    for (int v = 0; v < V; v++) wv[v] = _mm256_loadu_ps(w + (v / 2) * panel_elems + k * kPanel + (v % 2) * 8);
    if constexpr (avx2_prefetch_bytes(MB) > 0)
      for (int p = 0; p < NBT; p++)  // one 64-byte line per panel per k
        _mm_prefetch(reinterpret_cast<const char*>(w + p * panel_elems + k * kPanel) + avx2_prefetch_bytes(MB),
                     _MM_HINT_T0);
    for (int m = 0; m < MB; m++) {
      const __m256 xv = _mm256_set1_ps(x[m * ldx + k]);  // not broadcast_ss(ptr): GCC then keeps acc in memory
      for (int v = 0; v < V; v++) acc[m * V + v] = _mm256_fmadd_ps(wv[v], xv, acc[m * V + v]);
    }
  }
  for (int m = 0; m < MB; m++)
    for (int v = 0; v < V; v++) _mm256_storeu_ps(y + m * ldy + p0 * kPanel + v * 8, acc[m * V + v]);
}

// MB rows, all columns, over panels [p, end): tiles of NBT panels, then single panels.
template <int MB>
void avx2_rows(const float* x, int64_t K, const float* wp, int64_t p, int64_t end, float* y, int64_t ldy) {
  constexpr int NBT = avx2_panels_for(MB);
  for (; p + NBT <= end; p += NBT) tile_f32_avx2<MB, NBT>(x, K, K, 0, K, wp, p, y, ldy, false);
  for (; p < end; p++) tile_f32_avx2<MB, 1>(x, K, K, 0, K, wp, p, y, ldy, false);
}

template <int... MBs>
void avx2_all_rows(int64_t mb, const float* x, int64_t K, const float* wp, int64_t p, int64_t end, float* y,
                   int64_t ldy, std::integer_sequence<int, MBs...>) {
  ((mb == MBs + 1 ? avx2_rows<MBs + 1>(x, K, wp, p, end, y, ldy) : void()), ...);
}

template <int... MBs>
void avx2_chunk(int64_t mb, const float* x, int64_t K, int64_t k0, int64_t k1, const float* wp, int64_t p,
                float* y, int64_t ldy, std::integer_sequence<int, MBs...>) {
  ((mb == MBs + 1 ? tile_f32_avx2<MBs + 1, 1>(x, K, K, k0, k1, wp, p, y, ldy, k0 > 0) : void()), ...);
}

void run_f32_avx2(const float* x, const float* wp, int64_t M, int64_t panels, int64_t K, float* y) {
  const int64_t N = panels * kPanel;
  const auto rows = std::make_integer_sequence<int, kAvx2MaxRows>{};
  if (M <= kAvx2MaxRows) {
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      avx2_all_rows(M, x, K, wp, begin, end, y, N, rows);
    });
    return;
  }
  const int64_t groups = (M + kAvx2MaxRows - 1) / kAvx2MaxRows;  // as even as possible: 16 = 6 + 5 + 5
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; p++)
      for (int64_t k0 = 0; k0 < K; k0 += kChunk)
        for (int64_t g = 0, m0 = 0; g < groups; g++) {
          const int64_t mb = (M - m0) / (groups - g);
          avx2_chunk(mb, x + m0 * K, K, k0, std::min(K, k0 + kChunk), wp, p, y + m0 * N, N, rows);
          m0 += mb;
        }
  });
}

// MB rows over panels [begin, end): tiles of NBT panels, then single panels.
template <typename T, typename Out, int MB>
void rows_over_panels(const T* x, int64_t K, const T* wp, int64_t begin, int64_t end, Out* y, int64_t ldy) {
  constexpr int NBT = panels_for(MB);
  int64_t p = begin;
  if constexpr (std::is_same_v<T, float>) {
    for (; p + NBT <= end; p += NBT) tile_f32<MB, NBT>(x, K, wp, p, y, ldy);
    for (; p < end; p++) tile_f32<MB, 1>(x, K, wp, p, y, ldy);
  } else {
    for (; p + NBT <= end; p += NBT) tile_bf16<MB, NBT>(x, K, wp, p, y, ldy);
    for (; p < end; p++) tile_bf16<MB, 1>(x, K, wp, p, y, ldy);
  }
}

template <typename T, typename Out, int... MBs>
void dispatch_rows(int64_t mb, const T* x, int64_t K, const T* wp, int64_t begin, int64_t end, Out* y,
                   int64_t ldy, std::integer_sequence<int, MBs...>) {
  ((mb == MBs + 1 ? rows_over_panels<T, Out, MBs + 1>(x, K, wp, begin, end, y, ldy) : void()), ...);
}

template <typename T, typename Out>
void run(const T* x, const T* wp, int64_t M, int64_t panels, int64_t K, Out* y) {
  const int64_t N = panels * kPanel;
  // Threads split the panels (each weight byte is read by one thread, once); every thread
  // takes all rows, up to 16 at a time.
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += kMaxTileRows) {
      int64_t mb = std::min<int64_t>(kMaxTileRows, M - m0);
      dispatch_rows<T, Out>(mb, x + m0 * K, K, wp, begin, end, y + m0 * N, N,
                            std::make_integer_sequence<int, kMaxTileRows>{});
    }
  });
}

bool available(c10::ScalarType dtype) {
  return dtype == at::kBFloat16 ? kAvx512Bf16 : dtype == at::kFloat && (kAvx512 || kAvx2);
}

at::Tensor small_linear(const at::Tensor& x_in, const at::Tensor& wp) {
  const auto dtype = x_in.scalar_type();
  TORCH_CHECK(available(dtype), "gramsync::small_linear: no kernel for ", dtype, " on this CPU");
  TORCH_CHECK(wp.scalar_type() == dtype && wp.is_contiguous() && x_in.device().is_cpu(),
              "gramsync::small_linear: x and the packed weight must be CPU tensors of one dtype");
  const bool bf16 = dtype == at::kBFloat16;
  TORCH_CHECK(bf16 ? wp.dim() == 4 && wp.size(2) == kPanel && wp.size(3) == 2 : wp.dim() == 3 && wp.size(2) == kPanel,
              "gramsync::small_linear: weight not packed by cpu_gemv.pack_weight");
  const int64_t panels = wp.size(0), K = bf16 ? wp.size(1) * 2 : wp.size(1);
  TORCH_CHECK(x_in.size(-1) == K, "gramsync::small_linear: x has ", x_in.size(-1), " columns, weight ", K);
  at::Tensor x = x_in.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = panels * kPanel;
  at::Tensor y = at::empty(shape, x.options());
  const int64_t M = x.numel() / K;
  if (M == 0) return y;
  if (bf16)
    run(reinterpret_cast<const uint16_t*>(x.const_data_ptr()), reinterpret_cast<const uint16_t*>(wp.const_data_ptr()),
        M, panels, K, y.data_ptr<c10::BFloat16>());
  else if (kAvx512)
    run(x.const_data_ptr<float>(), wp.const_data_ptr<float>(), M, panels, K, y.data_ptr<float>());
  else
    run_f32_avx2(x.const_data_ptr<float>(), wp.const_data_ptr<float>(), M, panels, K, y.data_ptr<float>());
  return y;
}

}  // namespace

TORCH_LIBRARY(gramsync, m) {
  m.def("small_linear(Tensor x, Tensor wp) -> Tensor");
}

TORCH_LIBRARY_IMPL(gramsync, CPU, m) { m.impl("small_linear", small_linear); }
