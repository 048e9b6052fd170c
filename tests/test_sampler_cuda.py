"""GPU paths of the Sampler: the sort-free torch path on CUDA tensors and, when the
``flashinfer`` package is installed, FlashInfer's kernels. Skipped without CUDA."""
import pytest
import torch

from sampling.sampler import Sampler
from sampling.sampling_batch_info import SamplingBatchInfo
from sampling.sampling_params import SamplingParams
from sampling import flashinfer_backend
from srt.scheduler.req import Req

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _info(params, vocab, device, seed=0):
    reqs = [Req(str(i), (1, 2), p, False, frozenset()) for i, p in enumerate(params)]
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return SamplingBatchInfo.from_reqs(reqs, vocab, device, gen)


def test_seeded_rows_sample_the_same_tokens_on_cuda_as_on_cpu():
    torch.manual_seed(0)
    vocab = 5000
    logits = torch.randn(16, vocab) * 3
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=(-1 if i % 2 else 40),
                             min_p=(0.02 if i % 3 == 0 else 0.0), seed=100 + i) for i in range(16)]
    cpu = Sampler()(logits.clone(), _info(params, vocab, "cpu"))
    gpu = Sampler()(logits.clone().cuda(), _info(params, vocab, "cuda"))
    assert torch.equal(cpu, gpu.cpu())


def test_seeded_temperature_only_rows_sample_the_same_tokens_on_cuda_as_on_cpu():
    """Unfiltered rows (the two-level inverse CDF, the whole batch in one pass on CUDA)."""
    torch.manual_seed(1)
    vocab = 49152 + 7
    logits = torch.randn(16, vocab) * 3
    params = [SamplingParams(temperature=0.5 + 0.1 * i, seed=200 + i) for i in range(16)]
    cpu = Sampler()(logits.clone(), _info(params, vocab, "cpu"))
    gpu = Sampler()(logits.clone().cuda(), _info(params, vocab, "cuda"))
    assert torch.equal(cpu, gpu.cpu())


def test_unseeded_temperature_only_rows_on_cuda_match_the_softmax_distribution():
    torch.manual_seed(0)
    vocab, n = 1000, 200_000
    row = torch.randn(vocab) * 2
    info = _info([SamplingParams(temperature=0.7)] * n, vocab, "cuda")
    ids = Sampler()(row.cuda().expand(n, vocab).contiguous(), info).cpu()
    ref = torch.softmax(row.double() / 0.7, -1)
    emp = torch.bincount(ids, minlength=vocab).double() / n
    assert 0.5 * (emp - ref).abs().sum() < 0.02


@pytest.mark.skipif(not flashinfer_backend.installed(), reason="flashinfer not installed")
def test_flashinfer_path_matches_the_reference_distribution():
    torch.manual_seed(0)
    vocab, n = 1000, 200_000
    row = torch.randn(vocab) * 2
    info = _info([SamplingParams(temperature=1.0, top_k=50, top_p=0.9)] * n, vocab, "cuda")
    logits = row.cuda().expand(n, vocab).contiguous()
    assert flashinfer_backend.usable(logits, info)
    ids = Sampler()(logits, info).cpu()
    probs = torch.softmax(row.double(), -1)
    sorted_p, order = probs.sort(descending=True)
    keep = (torch.arange(vocab) < 50) & ((sorted_p.cumsum(0) - sorted_p) <= 0.9)
    ref = torch.zeros(vocab, dtype=torch.float64)
    ref[order] = sorted_p * keep / (sorted_p * keep).sum()
    emp = torch.bincount(ids, minlength=vocab).double() / n
    assert emp[ref == 0].sum() == 0
    assert 0.5 * (emp - ref).abs().sum() < 0.02
