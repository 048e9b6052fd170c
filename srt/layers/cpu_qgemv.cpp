// Quantized GEMVs for the decode step's matmuls at a few rows (M <= 16), AVX512-BF16:
//
// gramsync::int4_linear(x [M, K] bf16, wp uint8 [N/16, K/32, 320]) -> [M, N] bf16
//   4-bit codes with a bf16 scale and zero per 32 inputs of each output (value =
//   (code - 8) * scale + zero: torch's CPU int4 convention, so a GGUF's Q4_0 / Q4_1 codes go
//   in unchanged; cpu_qgemv.py packs them). Per 16-output panel and group of 32 inputs the
//   stream holds 256 bytes of codes (per 4 inputs, 32 bytes: byte 2n+j = code[n, 4q+j] |
//   code[n, 4q+2+j] << 4), then the 16 scales and the 16 zeros (bf16). A code becomes the
//   bf16 value code - 8 by one table lookup (vpermw) per 32 codes, and vdpbf16ps multiplies
//   pairs of inputs into one fp32 sum per output and group, D = sum((code - 8) * x); then
//   y += scale * D + zero * sum(x over the group). Exact products, fp32 sums.
// gramsync::int8_linear(x [M, K] bf16, wp int8 [N/16, K/2, 16, 2], scale fp32 [N]) -> [M, N] bf16
//   int8 weights with one scale per output (the int8 LM head of an int4 model), in the pair
//   layout of vdpbf16ps: each 32 weights widened to bf16 once (exact) and multiplied against
//   every row's x, fp32 sums, scaled once at the end.
//
// Why hand kernels: torch's int4 and int8 CPU kernels are compute-bound at one row, reading
// their weights at 9-17 GB/s where the machine reads ~30 (docs/speed.md "Quantized GEMVs");
// these read them at the machine's rate. A panel is one contiguous stream read once per
// tile of up to 8 rows (16 rows: two tiles, the panel re-read from cache). Threads split
// the panels. The reference is torch's kernels (tests/test_cpu_qgemv.py).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>
#include <immintrin.h>

#include <vector>

namespace {

constexpr int kPanel = 16;
constexpr int kGroup = 32;
constexpr int kCodeBytes = kGroup * kPanel / 2;        // 256
constexpr int kGroupBytes = kCodeBytes + 2 * kPanel * 2;  // + 16 bf16 scales + 16 bf16 zeros
constexpr int kTileRows = 8;

bool has_avx512_bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512bf16");
}
const bool kAvailable = has_avx512_bf16();

// Panels per tile: MB x NBT accumulators and as many group sums, plus NBT x 2 code vectors.
constexpr int int4_panels_for(int mb) { return mb <= 1 ? 8 : mb <= 2 ? 4 : mb <= 4 ? 2 : 1; }
constexpr int int8_panels_for(int mb) { return mb <= 1 ? 8 : mb <= 2 ? 4 : mb <= 4 ? 4 : 2; }

__attribute__((target("avx512f,avx512bw"))) inline __m512 bf16x16_to_f32(const void* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// Word i -> bf16((i & 15) - 8): vpermw reads the low 5 bits of each index word, whose bit 4
// is the other code's lowest bit in the low-nibble lookup.
struct CodeTable {
  alignas(64) uint16_t words[32];
  CodeTable() {
    for (int i = 0; i < 32; i++) {
      const float v = static_cast<float>((i & 15) - 8);
      uint32_t bits;
      __builtin_memcpy(&bits, &v, 4);
      words[i] = static_cast<uint16_t>(bits >> 16);  // exact: small integers
    }
  }
};
const CodeTable kCodeTable;

template <int MB, int NBT>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void tile_int4(
    const uint16_t* x, const float* xsum, int64_t K, const uint8_t* wp, int64_t p0, c10::BFloat16* y,
    int64_t ldy) {
  const int64_t G = K / kGroup;
  const int64_t panel_bytes = G * kGroupBytes;
  const __m512i table = _mm512_load_si512(kCodeTable.words);
  __m512 acc[MB][NBT];
  for (int m = 0; m < MB; m++)
    for (int p = 0; p < NBT; p++) acc[m][p] = _mm512_setzero_ps();
  const uint8_t* w = wp + p0 * panel_bytes;
  for (int64_t g = 0; g < G; g++) {
    // Two sums per output (low and high codes of each byte): shorter dependency chains.
    __m512 d[MB][NBT], e[MB][NBT];
    for (int m = 0; m < MB; m++)
      for (int p = 0; p < NBT; p++) d[m][p] = e[m][p] = _mm512_setzero_ps();
    if constexpr (MB == 1) {  // panel by panel: only one panel's codes live at a time
      for (int q = 0; q < kGroup / 4; q++) {
        int32_t a, b;
        __builtin_memcpy(&a, x + g * kGroup + 4 * q, 4);
        __builtin_memcpy(&b, x + g * kGroup + 4 * q + 2, 4);
        const __m512bh xa = (__m512bh)_mm512_set1_epi32(a), xb = (__m512bh)_mm512_set1_epi32(b);
        for (int p = 0; p < NBT; p++) {
          const uint8_t* at = w + p * panel_bytes + g * kGroupBytes + q * 32;
          const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
          d[0][p] = _mm512_dpbf16_ps(d[0][p], (__m512bh)_mm512_permutexvar_epi16(words, table), xa);
          e[0][p] = _mm512_dpbf16_ps(e[0][p], (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), table), xb);
        }
      }
    } else
    for (int q = 0; q < kGroup / 4; q++) {
      __m512bh lo[NBT], hi[NBT];
      for (int p = 0; p < NBT; p++) {
        const uint8_t* at = w + p * panel_bytes + g * kGroupBytes + q * 32;
        const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
        lo[p] = (__m512bh)_mm512_permutexvar_epi16(words, table);
        hi[p] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), table);
      }
      for (int m = 0; m < MB; m++) {
        int32_t a, b;
        __builtin_memcpy(&a, x + m * K + g * kGroup + 4 * q, 4);
        __builtin_memcpy(&b, x + m * K + g * kGroup + 4 * q + 2, 4);
        const __m512bh xa = (__m512bh)_mm512_set1_epi32(a), xb = (__m512bh)_mm512_set1_epi32(b);
        for (int p = 0; p < NBT; p++) {
          d[m][p] = _mm512_dpbf16_ps(d[m][p], lo[p], xa);
          e[m][p] = _mm512_dpbf16_ps(e[m][p], hi[p], xb);
        }
      }
    }
    for (int p = 0; p < NBT; p++) {
      const uint8_t* sz = w + p * panel_bytes + g * kGroupBytes + kCodeBytes;
      const __m512 scale = bf16x16_to_f32(sz), zero = bf16x16_to_f32(sz + 2 * kPanel);
      for (int m = 0; m < MB; m++) {
        acc[m][p] = _mm512_fmadd_ps(scale, _mm512_add_ps(d[m][p], e[m][p]), acc[m][p]);
        acc[m][p] = _mm512_fmadd_ps(zero, _mm512_set1_ps(xsum[m * G + g]), acc[m][p]);
      }
    }
  }
  for (int m = 0; m < MB; m++)
    for (int p = 0; p < NBT; p++)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * ldy + (p0 + p) * kPanel),
                          (__m256i)_mm512_cvtneps_pbh(acc[m][p]));
}

template <int MB, int NBT>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void tile_int8(
    const uint16_t* x, int64_t K, const int8_t* wp, const float* scale, int64_t p0, c10::BFloat16* y, int64_t ldy) {
  __m512 acc[MB][NBT];
  for (int m = 0; m < MB; m++)
    for (int p = 0; p < NBT; p++) acc[m][p] = _mm512_setzero_ps();
  const int64_t panel_elems = K * kPanel;  // K/2 pairs x 16 outputs x 2
  const int8_t* w = wp + p0 * panel_elems;
  for (int64_t k2 = 0; k2 < K / 2; k2++) {
    __m512bh wv[NBT];
    for (int p = 0; p < NBT; p++) {  // 32 codes -> bf16 (exact: |q| <= 127), once for every row
      const int8_t* at = w + p * panel_elems + k2 * 2 * kPanel;
      const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at))));
      const __m512 b =
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at + kPanel))));
      wv[p] = _mm512_cvtne2ps_pbh(b, a);  // outputs 0-7 from a (low half), 8-15 from b
    }
    for (int m = 0; m < MB; m++) {
      int32_t pair;
      __builtin_memcpy(&pair, x + m * K + 2 * k2, 4);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int p = 0; p < NBT; p++) acc[m][p] = _mm512_dpbf16_ps(acc[m][p], wv[p], xv);
    }
  }
  for (int p = 0; p < NBT; p++) {
    const __m512 s = _mm512_loadu_ps(scale + (p0 + p) * kPanel);
    for (int m = 0; m < MB; m++)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * ldy + (p0 + p) * kPanel),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[m][p], s)));
  }
}

// Every row of x over panels [begin, end): per tile of NBT panels, the rows in tiles of up
// to 8 (a panel tile re-read from cache by the later row tiles).
template <bool Int4, int... MBs>
void tiles(int64_t M, const void* x, const float* aux, int64_t K, const void* wp, int64_t begin, int64_t end,
           c10::BFloat16* y, int64_t N, std::integer_sequence<int, MBs...>) {
  auto run_tile = [&](auto mb_c, auto nbt_c, int64_t p, int64_t m0) {
    constexpr int MB = decltype(mb_c)::value, NBT = decltype(nbt_c)::value;
    if constexpr (Int4)
      tile_int4<MB, NBT>(static_cast<const uint16_t*>(x) + m0 * K, aux + m0 * (K / kGroup), K,
                         static_cast<const uint8_t*>(wp), p, y + m0 * N, N);
    else
      tile_int8<MB, NBT>(static_cast<const uint16_t*>(x) + m0 * K, K, static_cast<const int8_t*>(wp), aux, p,
                         y + m0 * N, N);
  };
  auto for_rows = [&](auto nbt_c, int64_t p) {
    for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
      const int64_t mb = std::min<int64_t>(kTileRows, M - m0);
      ((mb == MBs + 1 ? run_tile(std::integral_constant<int, MBs + 1>{}, nbt_c, p, m0) : void()), ...);
    }
  };
  // One panel width for every row tile: the widest the first tile's rows allow.
  const int64_t mb0 = std::min<int64_t>(kTileRows, M);
  const int nbt = Int4 ? int4_panels_for(mb0) : int8_panels_for(mb0);
  int64_t p = begin;
  if (nbt == 8)
    for (; p + 8 <= end; p += 8) for_rows(std::integral_constant<int, 8>{}, p);
  if (nbt >= 4)
    for (; p + 4 <= end; p += 4) for_rows(std::integral_constant<int, 4>{}, p);
  if (nbt >= 2)
    for (; p + 2 <= end; p += 2) for_rows(std::integral_constant<int, 2>{}, p);
  for (; p < end; p++) for_rows(std::integral_constant<int, 1>{}, p);
}

void check_x(const at::Tensor& x, int64_t K, const char* op) {
  TORCH_CHECK(kAvailable, op, ": needs AVX512-BF16");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16, op, ": x must be a bf16 CPU tensor");
  TORCH_CHECK(x.size(-1) == K, op, ": x has ", x.size(-1), " columns, the weight ", K);
}

at::Tensor output_like(const at::Tensor& x, int64_t N) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return at::empty(shape, x.options());
}

at::Tensor int4_linear(const at::Tensor& x_in, const at::Tensor& wp) {
  TORCH_CHECK(wp.scalar_type() == at::kByte && wp.dim() == 3 && wp.size(2) == kGroupBytes && wp.is_contiguous(),
              "gramsync::int4_linear: weight not packed by cpu_qgemv.pack_int4");
  const int64_t panels = wp.size(0), G = wp.size(1), K = G * kGroup, N = panels * kPanel;
  check_x(x_in, K, "gramsync::int4_linear");
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = output_like(x, N);
  const int64_t M = x.numel() / K;
  if (M == 0) return y;
  const auto* xp = x.const_data_ptr();
  // Each row's sum over each group of inputs (the zeros' term), fp32.
  std::vector<float> xsum(M * G);
  const auto* xb = static_cast<const c10::BFloat16*>(xp);
  for (int64_t i = 0; i < M * G; i++) {
    float sum = 0.f;
    for (int j = 0; j < kGroup; j++) sum += static_cast<float>(xb[i * kGroup + j]);
    xsum[i] = sum;
  }
  const float* sp = xsum.data();
  const auto* w = wp.const_data_ptr();
  auto* yp = y.data_ptr<c10::BFloat16>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    tiles<true>(M, xp, sp, K, w, begin, end, yp, N, std::make_integer_sequence<int, kTileRows>{});
  });
  return y;
}

at::Tensor int8_linear(const at::Tensor& x_in, const at::Tensor& wp, const at::Tensor& scale) {
  TORCH_CHECK(wp.scalar_type() == at::kChar && wp.dim() == 4 && wp.size(2) == kPanel && wp.size(3) == 2 &&
                  wp.is_contiguous(),
              "gramsync::int8_linear: weight not packed by cpu_qgemv.pack_int8");
  const int64_t panels = wp.size(0), K = wp.size(1) * 2, N = panels * kPanel;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == N && scale.is_contiguous(),
              "gramsync::int8_linear: scale must be fp32 [N]");
  check_x(x_in, K, "gramsync::int8_linear");
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = output_like(x, N);
  const int64_t M = x.numel() / K;
  if (M == 0) return y;
  const auto* xp = x.const_data_ptr();
  const float* sp = scale.const_data_ptr<float>();
  const auto* w = wp.const_data_ptr();
  auto* yp = y.data_ptr<c10::BFloat16>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    tiles<false>(M, xp, sp, K, w, begin, end, yp, N, std::make_integer_sequence<int, kTileRows>{});
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gramsync, m) {
  m.def("int4_linear(Tensor x, Tensor wp) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor wp, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(gramsync, CPU, m) {
  m.impl("int4_linear", int4_linear);
  m.impl("int8_linear", int8_linear);
}
