"""Statistical correctness of the Sampler against an exact float64 reference.

One logits row is repeated N times in a batch (unseeded rows draw independent uniforms),
the token counts are compared with the reference distribution (float64 softmax of
logits / T, sorted, SGLang's joint top-k / top-p / min-p rule, renormalised) by a
chi-square goodness-of-fit test, and no sample may fall outside the reference support.
scipy is not in the venv, so the chi-square survival function is computed here exactly
(regularised upper incomplete gamma, Numerical Recipes' series / Lentz continued
fraction) and checked against known quantiles. Fixed seeds: every run draws the same
samples. Torch is limited to one thread: on a shared 2-core machine OpenMP spin-waits
make the sampler's small per-chunk ops many times slower.
"""
from __future__ import annotations

import logging
import math

import pytest
import torch

from sampling.sampler import Sampler
from sampling.sampling_batch_info import SamplingBatchInfo
from sampling.sampling_params import SamplingParams
from srt.scheduler.req import Req

P_REJECT = 1e-4


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_info(params: list[SamplingParams], vocab: int, gen_seed: int = 0) -> SamplingBatchInfo:
    reqs = [Req(f"r{i}", (1, 2, 3), p, stream=False, eos_token_ids=frozenset())
            for i, p in enumerate(params)]
    return SamplingBatchInfo.from_reqs(reqs, vocab, "cpu", torch.Generator().manual_seed(gen_seed))


def reference_probs(row: torch.Tensor, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0):
    """Exact float64 target distribution over the vocabulary."""
    p = torch.softmax(row.double() / temperature, dim=0)
    ps, order = torch.sort(p, descending=True)
    keep = ((torch.cumsum(ps, 0) - ps) <= top_p) & (ps >= min_p * ps[0])
    if top_k > 0:
        keep &= torch.arange(len(ps)) < top_k
    q = torch.zeros_like(p)
    q[order[keep]] = ps[keep]
    return q / q.sum()


def draw_counts(row: torch.Tensor, params: SamplingParams, n: int, batch: int = 2000,
                gen_seed: int = 0) -> torch.Tensor:
    """Token counts of n samples of ``row`` under ``params`` (n // batch calls)."""
    v = row.numel()
    info, sampler = make_info([params] * batch, v, gen_seed), Sampler()
    counts = torch.zeros(v, dtype=torch.int64)
    for _ in range(n // batch):
        ids = sampler(row.expand(batch, v).clone(), info)
        counts += torch.bincount(ids, minlength=v)
    return counts


def chi2_sf(x: float, df: int) -> float:
    """P(chi2_df > x) = Q(df/2, x/2), the regularised upper incomplete gamma function."""
    a, x = df / 2.0, x / 2.0
    if x <= 0:
        return 1.0
    log_front = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:  # series for the lower function P
        term = total = 1.0 / a
        n = a
        while term > total * 1e-16:
            n += 1
            term *= x / n
            total += term
        return max(0.0, 1.0 - total * math.exp(log_front))
    tiny = 1e-300  # modified Lentz continued fraction for Q
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 100000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-16:
            break
    return math.exp(log_front) * h


def goodness_of_fit(counts: torch.Tensor, q: torch.Tensor) -> tuple[float, int, int]:
    """(p-value, samples outside the support of q, number of bins). Bins follow the
    reference's rank order; neighbours are merged until each expects >= 5 samples (a
    short tail joins the last bin), so flat distributions still get many bins."""
    n = int(counts.sum())
    outside = int(counts[q == 0].sum())
    order = torch.argsort(q, descending=True)
    order = order[q[order] > 0]
    exp_all, obs_all = (q[order] * n).tolist(), counts[order].tolist()
    bins, e_acc, o_acc = [], 0.0, 0
    for e, o in zip(exp_all, obs_all):
        e_acc, o_acc = e_acc + e, o_acc + o
        if e_acc >= 5:
            bins.append((e_acc, o_acc))
            e_acc, o_acc = 0.0, 0
    if bins and e_acc > 0:
        bins[-1] = (bins[-1][0] + e_acc, bins[-1][1] + o_acc)
    stat = sum((o - e) ** 2 / e for e, o in bins)
    return chi2_sf(stat, len(bins) - 1) if len(bins) > 1 else 1.0, outside, len(bins)


def assert_fits(counts: torch.Tensor, q: torch.Tensor, min_bins: int = 5) -> None:
    p, outside, nbins = goodness_of_fit(counts, q)
    assert outside == 0, f"{outside} samples outside the reference support"
    assert nbins >= min_bins, f"only {nbins} chi-square bins: the test would have no power"
    assert p >= P_REJECT, f"chi-square rejects the sampler: p={p:.3g} over {nbins} bins"


def lm_row(v: int, scale: float, seed: int, masked_tail: int = 0, head=()) -> torch.Tensor:
    """randn * scale; ``head`` logits go to random positions (dominant tokens)."""
    gen = torch.Generator().manual_seed(seed)
    row = torch.randn(v, generator=gen) * scale
    row[torch.randperm(v - masked_tail, generator=gen)[:len(head)]] = torch.tensor(head)
    if masked_tail:
        row[-masked_tail:] = float("-inf")  # like a padded LM head / grammar mask
    return row


def test_chi2_sf_matches_known_quantiles():
    for x, df in [(3.841458820694124, 1), (18.307038053275146, 10), (124.342113404, 100),
                  (1074.679449, 1000)]:  # 95% quantiles
        assert chi2_sf(x, df) == pytest.approx(0.05, rel=1e-6)
    assert chi2_sf(135.806723, 100) == pytest.approx(0.01, rel=1e-5)
    for x in (0.1, 1.0, 7.0, 40.0):  # df = 2: exp(-x / 2) exactly
        assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-9)


CASES = {  # name: (V, scale, masked tail, params, samples)
    "temperature": (1000, 2.0, 0, dict(temperature=0.7), 20000),
    "temperature_padded": (3001, 2.0, 500, dict(temperature=1.3), 10000),
    "top_k": (3001, 2.0, 0, dict(top_k=20), 10000),
    "top_k_large_retry": (3001, 0.5, 0, dict(top_k=1500), 6000),
    "top_p": (3001, 2.0, 0, dict(top_p=0.9), 8000),
    "min_p": (2000, 2.0, 0, dict(min_p=0.1), 20000),
    "t_topk_topp": (4099, 2.0, 0, dict(temperature=0.7, top_k=20, top_p=0.9), 20000),
    "topp_minp": (2000, 2.0, 300, dict(top_p=0.8, min_p=0.05), 20000),
    "all_four": (3001, 2.0, 0, dict(temperature=0.8, top_k=50, top_p=0.95, min_p=0.02), 20000),
    "peaky_top_p": (1500, 6.0, 0, dict(top_p=0.99), 20000),
    "flat_retry_2048": (5000, 0.3, 0, dict(top_p=0.4), 4000),
    "flat_retry_full_vocab": (5000, 0.01, 0, dict(top_p=0.95), 2000),
    # p ~ .40, .25, .15 then a flat tail: top_p=0.7 keeps exactly the token that crosses it
    "top_p_boundary_token": (2000, 0.5, 0, dict(top_p=0.7), 10000, (8.42, 7.95, 7.44)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference_distribution(name):
    v, scale, masked, kw, n, *head = CASES[name]
    row = lm_row(v, scale, seed=len(name), masked_tail=masked, head=head[0] if head else ())
    q = reference_probs(row, **kw)
    support = int((q > 0).sum())
    if name.startswith("flat"):  # > 256 initial candidates; "full": > 2048 (second try) too
        assert support > 256 and (support > 2048) == ("full" in name)
    counts = draw_counts(row, SamplingParams(**kw), n, batch=1000 if v >= 5000 else 2000)
    assert_fits(counts, q, min_bins=min(5, support))


def test_mixed_filtered_and_unfiltered_rows_in_one_batch():
    """Filtered and unfiltered rows take separate paths; each half keeps its own law."""
    v, half = 2000, 1000
    row = lm_row(v, 2.0, seed=7)
    params = [SamplingParams(temperature=0.7, top_k=30, top_p=0.9), SamplingParams(temperature=1.2)]
    info, sampler = make_info([params[i % 2] for i in range(2 * half)], v), Sampler()
    counts = torch.zeros(2, v, dtype=torch.int64)
    for _ in range(10):
        ids = sampler(row.expand(2 * half, v).clone(), info).view(half, 2)
        for j in range(2):
            counts[j] += torch.bincount(ids[:, j], minlength=v)
    assert_fits(counts[0], reference_probs(row, temperature=0.7, top_k=30, top_p=0.9))
    assert_fits(counts[1], reference_probs(row, temperature=1.2))


def test_self_check_rejects_wrong_distributions():
    """The same machinery must fail on a wrong reference: by chi-square (T=0.7 samples vs
    a T=1 reference; top_p=0.8 samples vs top_p=0.9) and by support (0.9 vs 0.8)."""
    row = lm_row(2000, 2.0, seed=11)
    c_t = draw_counts(row, SamplingParams(temperature=0.7), 6000)
    assert_fits(c_t, reference_probs(row, temperature=0.7))
    with pytest.raises(AssertionError, match="chi-square rejects"):
        assert_fits(c_t, reference_probs(row, temperature=1.0))
    c_08 = draw_counts(row, SamplingParams(top_p=0.8), 6000)
    c_09 = draw_counts(row, SamplingParams(top_p=0.9), 6000)
    assert_fits(c_08, reference_probs(row, top_p=0.8))
    with pytest.raises(AssertionError, match="chi-square rejects"):
        assert_fits(c_08, reference_probs(row, top_p=0.9))
    with pytest.raises(AssertionError, match="outside the reference support"):
        assert_fits(c_09, reference_probs(row, top_p=0.8))


def test_greedy_fast_path_and_mixed_batches():
    b, v = 64, 3001
    logits = torch.randn(b, v, generator=torch.Generator().manual_seed(3)) * 0.5
    argmax = logits.argmax(dim=1)
    for greedy in (SamplingParams(temperature=0.0), SamplingParams(top_k=1, temperature=0.9)):
        info = make_info([greedy] * b, v)
        assert info.is_all_greedy
        assert torch.equal(Sampler()(logits.clone(), info), argmax)
    sampled = [SamplingParams(temperature=1.0), SamplingParams(top_k=5, top_p=0.9)]
    params = [SamplingParams(temperature=0.0) if i % 3 == 0 else sampled[i % 2] for i in range(b)]
    greedy_rows = torch.tensor([i % 3 == 0 for i in range(b)])
    info = make_info(params, v)
    assert info.has_greedy and not info.is_all_greedy
    ids = Sampler()(logits.clone(), info)
    assert torch.equal(ids[greedy_rows], argmax[greedy_rows])
    assert (ids[~greedy_rows] != argmax[~greedy_rows]).sum() > 10  # flat rows really sample
    top5 = logits.topk(5, dim=1).indices
    for i in range(b):
        if i % 3 and i % 2:  # top_k=5 rows stay inside their top 5
            assert ids[i] in top5[i]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8),
                                    SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.01)],
                         ids=["greedy", "temperature", "filtered"])
def test_non_finite_rows_do_not_raise_and_warn_once(params, caplog):
    """NaN counts as masked (-inf), +inf wins, a row with nothing finite is uniform."""
    v, n = 1500, 200
    base = torch.randn(v, generator=torch.Generator().manual_seed(5))
    nan_some, nan_all_but_one, pos_inf = base.clone(), torch.full((v,), float("nan")), base.clone()
    nan_some[::2] = float("nan")
    nan_all_but_one[123] = 0.5
    pos_inf[777] = float("inf")
    rows = [nan_some, nan_all_but_one, pos_inf, torch.full((v,), float("-inf")),
            torch.full((v,), float("nan")), base]
    logits = torch.stack([r for r in rows for _ in range(n)])
    sampler = Sampler(log_prefix="[test]")
    with caplog.at_level(logging.WARNING, logger="sampling.sampler"):
        for _ in range(2):
            ids = sampler(logits.clone(), make_info([params] * len(logits), v)).view(len(rows), n)
    warnings = [r for r in caplog.records if "non-finite" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert ((ids >= 0) & (ids < v)).all()
    assert (ids[0] % 2 == 1).all()  # never a NaN token
    assert (ids[1] == 123).all() and (ids[2] == 777).all()
    if params.temperature > 0:  # all -inf: uniform (over the top_k=40 tie-broken ranks)
        assert len(set(ids[3].tolist())) > (20 if params.top_k > 0 else n // 2)
