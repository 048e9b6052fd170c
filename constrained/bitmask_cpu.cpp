// gramsync::apply_token_bitmask_(logits [B, V] fp32 / bf16 / fp16, bitmask int32 [B, W]):
// the CPU path of constrained/bitmask_ops.py in one pass. Bit j of word w allows token
// 32 w + j; a 0 bit sets that logit to -inf whatever it held, 1 bits leave theirs. Words
// of all ones are skipped, words of all zeros filled whole, others walk their zero bits:
// ~10 us for SmolLM2's 49,152 logits at any sparsity, where the tiled torch ops took
// 130-240 us in bf16. Runs on the calling thread (it may run beside the forward on the
// mask-fill thread: no OpenMP team). Built with the CPU kernels (srt/layers/cpu_kernels.py).
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace {

template <typename Bits>
void apply(Bits* x, int64_t batch, int64_t vocab, int64_t row_stride, const int32_t* mask, int64_t words,
           Bits neg_inf) {
  for (int64_t r = 0; r < batch; r++) {
    Bits* row = x + r * row_stride;
    const uint32_t* m = reinterpret_cast<const uint32_t*>(mask + r * words);
    for (int64_t w = 0; w * 32 < vocab; w++) {
      const uint32_t bits = m[w];
      if (bits == 0xFFFFFFFFu) continue;
      const int64_t base = w * 32, n = vocab - base < 32 ? vocab - base : 32;
      if (bits == 0) {
        for (int64_t j = 0; j < n; j++) row[base + j] = neg_inf;
        continue;
      }
      for (uint32_t zeros = ~bits; zeros; zeros &= zeros - 1) {
        const int j = __builtin_ctz(zeros);
        if (j < n) row[base + j] = neg_inf;
      }
    }
  }
}

void apply_token_bitmask_(at::Tensor logits, const at::Tensor& bitmask) {
  TORCH_CHECK(logits.device().is_cpu() && bitmask.device().is_cpu(), "apply_token_bitmask_: CPU tensors only");
  TORCH_CHECK(logits.dim() == 2 && bitmask.dim() == 2 && logits.size(0) == bitmask.size(0),
              "apply_token_bitmask_: logits [B, V] and bitmask [B, W]");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(), "apply_token_bitmask_: int32 contiguous mask");
  TORCH_CHECK(logits.stride(1) == 1, "apply_token_bitmask_: logits rows must be contiguous");
  const int64_t batch = logits.size(0), vocab = logits.size(1), words = bitmask.size(1);
  TORCH_CHECK(words * 32 >= vocab, "apply_token_bitmask_: the mask covers ", words * 32, " tokens, logits ", vocab);
  const auto dtype = logits.scalar_type();
  if (dtype == at::kFloat) {
    const float inf = -__builtin_inff();
    uint32_t bits;
    std::memcpy(&bits, &inf, 4);
    apply(static_cast<uint32_t*>(logits.data_ptr()), batch, vocab, logits.stride(0), bitmask.const_data_ptr<int32_t>(),
          words, bits);
  } else {
    TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, "apply_token_bitmask_: fp32, bf16 or fp16 logits");
    const uint16_t neg_inf = dtype == at::kBFloat16 ? 0xFF80 : 0xFC00;
    apply(static_cast<uint16_t*>(logits.data_ptr()), batch, vocab, logits.stride(0), bitmask.const_data_ptr<int32_t>(),
          words, neg_inf);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gramsync, m) { m.def("apply_token_bitmask_(Tensor(a!) logits, Tensor bitmask) -> ()"); }

TORCH_LIBRARY_IMPL(gramsync, CPU, m) { m.impl("apply_token_bitmask_", apply_token_bitmask_); }
