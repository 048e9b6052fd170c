// gramsync::decode_attention(q [B, H, D], k [KVH, N, D], v [KVH, N, D], slots [B, S], valid [B, S],
// scaling) -> [B, H, D]: one decode token per row against its keys in the token-level KV pool,
// read in place through the slot table. The torch path (torch_native.decode_attention) gathers
// every row's keys and values into a fresh block, casts it, and runs two batched matmuls: at 16
// rows it writes and re-reads about twice the bytes of the keys themselves. Here each (row,
// kv head) task reads its keys and values once, straight from the pool, and its G = H / KVH
// query heads share every load (GQA); where tasks are fewer than two a thread, a row's keys are
// split into chunks whose partial results are rejoined (flash-decoding). Scores, softmax and the weighted sum are fp32 (the torch
// path's small batches compute in fp32 too); the output is rounded once to q's dtype.
// AVX-512 intrinsics for head sizes 64 and 128; elsewhere the same algorithm as plain loops over
// 16-lane blocks that the compiler vectorises for the CPU it runs on (AVX-512, AVX2 or neither,
// chosen at run time). Sums run in 16 lanes, then a fixed tree: no -ffast-math reassociation.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <limits>
#include <vector>

namespace {

constexpr int kLanes = 16;

inline __attribute__((always_inline)) void to_float(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}
inline __attribute__((always_inline)) void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; i++) {
    uint32_t u = static_cast<uint32_t>(bits[i]) << 16;
    std::memcpy(dst + i, &u, 4);
  }
}

// Sums in 16 independent lanes, then a fixed tree: vectorises without -ffast-math, and the
// generic loops add in the same order on every machine (the AVX-512 path reduces with
// _mm512_reduce_add_ps, in its own fixed order).
inline __attribute__((always_inline)) float tree(float* part) {
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; l++) part[l] += part[l + w];
  return part[0];
}

inline __attribute__((always_inline)) float dot(const float* a, const float* b, int64_t n) {
  float part[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; l++) part[l] += a[i + l] * b[i + l];
  for (int l = 0; i < n; i++, l++) part[l] += a[i] * b[i];
  return tree(part);
}

inline __attribute__((always_inline)) float lane_sum(const float* a, int64_t n) {
  float part[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; l++) part[l] += a[i + l];
  for (int l = 0; i < n; i++, l++) part[l] += a[i];
  return tree(part);
}

// exp(x) for x <= 0 (scores minus their max), to ~2 ulp: x = n ln2 + r, |r| <= ln2 / 2, a degree-6
// polynomial for e^r, 2^n from the exponent bits. Branch-free, so a loop of it vectorises
// (std::exp is a scalar libm call the compiler cannot vectorise).
inline __attribute__((always_inline)) float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;  // below: e^x underflows; clamping keeps 2^n a normal float
  const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;  // ln2 split in two for an exact first product
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// Scores [G, n] -> unnormalised weights in place, and each row's sum. A masked key (-inf), and
// any key below e^-87 of the best, weighs exactly 0 (so does every key of a chunk with none
// valid: its max is -inf and x is NaN).
inline __attribute__((always_inline)) void softmax(float* scores, const float* mx, int64_t G, int64_t n,
                                                   float* sum) {
  for (int64_t g = 0; g < G; g++) {
    float* sg = scores + g * n;
    const float m = mx[g];
    for (int64_t j = 0; j < n; j++) {
      const float x = sg[j] - m;
      sg[j] = x >= -87.0f ? exp_nonpositive(x) : 0.f;
    }
    sum[g] = lane_sum(sg, n);
  }
}

struct Task {
  int64_t B, H, KVH, S, D;
  const void* q;
  int64_t q_s0, q_s1;
  const void *k, *v;
  int64_t kv_s0, kv_s1;
  const int64_t* slots;
  const bool* valid;
  float scaling;
  void* out;
};

// One chunk: row b, kv head h, keys [j0, j0 + n). Its G query heads scaled into fp32 (qf
// [G, D]), where its keys, values and slot-table entries start, and its partial result
// `part`: the max score [G], the sum of weights [G], the unnormalised weighted values [G, D].
template <typename T>
struct Chunk {
  const T *k, *v;
  const int64_t* slots;
  const bool* valid;
  int64_t n;
  float *mx, *sum, *acc;
};

template <typename T>
inline __attribute__((always_inline)) Chunk<T> begin_chunk(const Task& t, int64_t b, int64_t h, int64_t j0,
                                                           int64_t n, float* qf, float* part) {
  const int64_t G = t.H / t.KVH, D = t.D;
  const T* q = static_cast<const T*>(t.q);
  for (int64_t g = 0; g < G; g++) {
    to_float(q + b * t.q_s0 + (h * G + g) * t.q_s1, qf + g * D, D);
    for (int64_t d = 0; d < D; d++) qf[g * D + d] *= t.scaling;
  }
  for (int64_t g = 0; g < G; g++) part[g] = -std::numeric_limits<float>::infinity();
  return {static_cast<const T*>(t.k) + h * t.kv_s0, static_cast<const T*>(t.v) + h * t.kv_s0,
          t.slots + b * t.S + j0, t.valid + b * t.S + j0, n, part, part + G, part + 2 * G};
}

// Portable: plain loops the compiler vectorises for the target it is compiled for.
template <typename T>
inline __attribute__((always_inline)) void attend_impl(const Task& t, int64_t b, int64_t h, int64_t j0, int64_t n,
                                                       float* scratch, float* part) {
  const int64_t G = t.H / t.KVH, D = t.D;
  float* qf = scratch;          // [G, D]
  float* row = qf + G * D;      // [D]: one key or value in fp32
  float* scores = row + D;      // [G, n]
  const Chunk<T> c = begin_chunk<T>(t, b, h, j0, n, qf, part);
  for (int64_t j = 0; j < n; j++) {
    if (!c.valid[j]) {
      for (int64_t g = 0; g < G; g++) scores[g * n + j] = -std::numeric_limits<float>::infinity();
      continue;
    }
    to_float(c.k + c.slots[j] * t.kv_s1, row, D);
    for (int64_t g = 0; g < G; g++) {
      const float s = dot(qf + g * D, row, D);
      scores[g * n + j] = s;
      c.mx[g] = s > c.mx[g] ? s : c.mx[g];
    }
  }
  softmax(scores, c.mx, G, n, c.sum);
  std::fill(c.acc, c.acc + G * D, 0.f);
  for (int64_t j = 0; j < n; j++) {
    if (!c.valid[j]) continue;
    to_float(c.v + c.slots[j] * t.kv_s1, row, D);
    for (int64_t g = 0; g < G; g++) {
      const float p = scores[g * n + j];
      float* a = c.acc + g * D;
      for (int64_t d = 0; d < D; d++) a[d] += p * row[d];
    }
  }
}

template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl,fma"))) void attend_any_avx512(
    const Task& t, int64_t b, int64_t h, int64_t j0, int64_t n, float* s, float* part) {
  attend_impl<T>(t, b, h, j0, n, s, part);
}
template <typename T>
__attribute__((target("avx2,fma"))) void attend_avx2(const Task& t, int64_t b, int64_t h, int64_t j0, int64_t n,
                                                     float* s, float* part) {
  attend_impl<T>(t, b, h, j0, n, s, part);
}
template <typename T>
void attend_generic(const Task& t, int64_t b, int64_t h, int64_t j0, int64_t n, float* s, float* part) {
  attend_impl<T>(t, b, h, j0, n, s, part);
}

// AVX-512 for head sizes of 64 and 128 (NV = D / 16 registers a row): the row of a key or value
// is loaded (and widened from bf16) once into registers and used by every query head of the
// group; the value sums of up to GB heads stay in registers across all keys.
#define GS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))

template <typename T, int NV>
GS_AVX512 inline __attribute__((always_inline)) void load_row(const T* src, __m512* r) {
  for (int i = 0; i < NV; i++) {
    if constexpr (std::is_same_v<T, float>) {
      r[i] = _mm512_loadu_ps(src + 16 * i);
    } else {
      const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 16 * i)));
      r[i] = _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
    }
  }
}

template <typename T, int NV>
GS_AVX512 void scores_avx512(const Task& t, const float* qf, const Chunk<T>& c, int64_t G, float* scores) {
  const int64_t n = c.n;
  for (int64_t j = 0; j < n; j++) {
    if (!c.valid[j]) {
      for (int64_t g = 0; g < G; g++) scores[g * n + j] = -std::numeric_limits<float>::infinity();
      continue;
    }
    __m512 r[NV];
    load_row<T, NV>(c.k + c.slots[j] * t.kv_s1, r);
    for (int64_t g = 0; g < G; g++) {
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qf + g * NV * 16), r[0]);
      for (int i = 1; i < NV; i++) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qf + (g * NV + i) * 16), r[i], acc);
      const float sc = _mm512_reduce_add_ps(acc);
      scores[g * n + j] = sc;
      c.mx[g] = sc > c.mx[g] ? sc : c.mx[g];
    }
  }
}

// acc[g0 .. g0 + GB) = the sum over valid keys of weight x value.
template <typename T, int NV, int GB>
GS_AVX512 void values_avx512(const Task& t, const Chunk<T>& c, const float* w, int64_t g0) {
  const int64_t n = c.n;
  __m512 acc[GB][NV];
  for (int g = 0; g < GB; g++)
    for (int i = 0; i < NV; i++) acc[g][i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j++) {
    if (!c.valid[j]) continue;
    __m512 r[NV];
    load_row<T, NV>(c.v + c.slots[j] * t.kv_s1, r);
    for (int g = 0; g < GB; g++) {
      const __m512 p = _mm512_set1_ps(w[(g0 + g) * n + j]);
      for (int i = 0; i < NV; i++) acc[g][i] = _mm512_fmadd_ps(p, r[i], acc[g][i]);
    }
  }
  for (int g = 0; g < GB; g++)
    for (int i = 0; i < NV; i++) _mm512_storeu_ps(c.acc + (g0 + g) * NV * 16 + 16 * i, acc[g][i]);
}

template <typename T, int NV>
GS_AVX512 void attend_avx512(const Task& t, int64_t b, int64_t h, int64_t j0, int64_t n, float* scratch,
                             float* part) {
  constexpr int GB = 16 / NV;  // 16 accumulator registers of 32
  const int64_t G = t.H / t.KVH;
  float* qf = scratch;              // [G, D]
  float* scores = qf + G * NV * 16; // [G, n]
  const Chunk<T> c = begin_chunk<T>(t, b, h, j0, n, qf, part);
  scores_avx512<T, NV>(t, qf, c, G, scores);
  softmax(scores, c.mx, G, n, c.sum);
  int64_t g0 = 0;
  for (; g0 + GB <= G; g0 += GB) values_avx512<T, NV, GB>(t, c, scores, g0);
  for (; g0 < G; g0++) values_avx512<T, NV, 1>(t, c, scores, g0);
}

// out[b, h's heads] from the chunks' partial results: rescaled to the common max, summed,
// divided by the total weight. One chunk (the usual case) is its own result.
template <typename T>
void combine(const Task& t, const float* parts, int64_t chunks, int64_t task) {
  const int64_t G = t.H / t.KVH, D = t.D, b = task / t.KVH, h = task % t.KVH, stride = G * (D + 2);
  T* out = static_cast<T*>(t.out) + b * t.H * D + h * G * D;
  std::vector<float> res(D);
  for (int64_t g = 0; g < G; g++) {
    float m = -std::numeric_limits<float>::infinity(), total = 0.f;
    for (int64_t c = 0; c < chunks; c++) m = std::max(m, parts[c * stride + g]);
    std::fill(res.begin(), res.end(), 0.f);
    for (int64_t c = 0; c < chunks; c++) {
      const float* part = parts + c * stride;
      const float x = part[g] - m;
      const float w = x >= -87.0f ? exp_nonpositive(x) : 0.f;
      total += w * part[G + g];
      for (int64_t d = 0; d < D; d++) res[d] += w * part[2 * G + g * D + d];
    }
    const float inv = total > 0.f ? 1.f / total : 0.f;
    for (int64_t d = 0; d < D; d++) out[g * D + d] = static_cast<T>(res[d] * inv);
  }
}

int isa_level() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
    return 2;
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1 : 0;
}
const int kIsa = isa_level();

// Keys a chunk holds at least, when a row's keys are split (flash-decoding): below this the
// split's combine costs more than the idle thread it saves.
constexpr int64_t kMinChunkKeys = 256;

template <typename T>
void run(const Task& t) {
  auto fn = kIsa == 2 ? (t.D == 64 ? attend_avx512<T, 4> : t.D == 128 ? attend_avx512<T, 8> : attend_any_avx512<T>)
            : kIsa == 1 ? attend_avx2<T> : attend_generic<T>;
  const int64_t G = t.H / t.KVH, tasks = t.B * t.KVH, threads = at::get_num_threads();
  // Few (row, kv head) tasks for the threads (one long chat: 3 for 2 threads) leave threads
  // idle: split each row's keys into chunks so there are about two tasks a thread.
  int64_t chunks = 1;
  if (tasks < 2 * threads)
    chunks = std::max<int64_t>(1, std::min((2 * threads + tasks - 1) / tasks, t.S / kMinChunkKeys));
  const int64_t per_chunk = (t.S + chunks - 1) / chunks;
  chunks = (t.S + per_chunk - 1) / per_chunk;
  const int64_t stride = G * (t.D + 2);
  std::vector<float> parts(tasks * chunks * stride);
  at::parallel_for(0, tasks * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(G * t.D + t.D + G * per_chunk);
    for (int64_t i = begin; i < end; i++) {
      const int64_t task = i / chunks, j0 = (i % chunks) * per_chunk;
      fn(t, task / t.KVH, task % t.KVH, j0, std::min(per_chunk, t.S - j0), scratch.data(), parts.data() + i * stride);
    }
  });
  at::parallel_for(0, tasks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; task++) combine<T>(t, parts.data() + task * chunks * stride, chunks, task);
  });
}

at::Tensor decode_attention(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& slots_in, const at::Tensor& valid_in, double scaling) {
  const auto dtype = q_in.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "gramsync::decode_attention: float32 or bfloat16, not ", dtype);
  TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype && q_in.device().is_cpu() && k.device().is_cpu(),
              "gramsync::decode_attention: q, k and v must be CPU tensors of one dtype");
  TORCH_CHECK(q_in.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && v.strides() == k.strides(),
              "gramsync::decode_attention: q [B, H, D], k and v [KVH, N, D] of one layout");
  TORCH_CHECK(k.stride(2) == 1, "gramsync::decode_attention: k and v need contiguous rows");
  const int64_t B = q_in.size(0), H = q_in.size(1), D = q_in.size(2), KVH = k.size(0);
  TORCH_CHECK(k.size(2) == D && KVH > 0 && H % KVH == 0 && H / KVH <= 64,
              "gramsync::decode_attention: heads ", H, " and kv heads ", KVH, " or head size do not fit");
  TORCH_CHECK(slots_in.dim() == 2 && slots_in.size(0) == B && valid_in.sizes() == slots_in.sizes() &&
                  slots_in.scalar_type() == at::kLong && valid_in.scalar_type() == at::kBool,
              "gramsync::decode_attention: slots (int64) and valid (bool) must both be [B, S]");
  at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  at::Tensor slots = slots_in.contiguous(), valid = valid_in.contiguous();
  at::Tensor out = at::empty({B, H, D}, q.options());
  if (B == 0) return out;
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  const bool* vp = valid.const_data_ptr<bool>();
  for (int64_t i = 0; i < slots.numel(); i++)  // a bad slot would read outside the pool
    TORCH_CHECK(!vp[i] || (sp[i] >= 0 && sp[i] < k.size(1)), "gramsync::decode_attention: slot ", sp[i],
                " outside the pool of ", k.size(1));
  Task t{B, H, KVH, slots.size(1), D, q.const_data_ptr(), q.stride(0), q.stride(1), k.const_data_ptr(),
         v.const_data_ptr(), k.stride(0), k.stride(1), slots.const_data_ptr<int64_t>(),
         valid.const_data_ptr<bool>(), static_cast<float>(scaling), out.data_ptr()};
  if (dtype == at::kBFloat16)
    run<c10::BFloat16>(t);
  else
    run<float>(t);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gramsync, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor valid, float scaling) -> Tensor");
}

TORCH_LIBRARY_IMPL(gramsync, CPU, m) { m.impl("decode_attention", decode_attention); }
