"""The batch hand-off (megaforge.driver.handoff, issue 22 item 6) on 1, 2 and 4 gloo ranks of the same
batch: every rank receives exactly its share's tensors (bytes computed from the shapes, so 1/DP of the
batch) and holds only its share's per-token tensors after the passes; the step's metrics name both;
the per-token results, advantages and training metrics are those of one process. Advantages that
read the trainer's per-token results (the KL in the reward, the critic's values) are computed on
every rank's share: the main rank receives no per-token data for them, whatever the DP size, and
they equal one process's computation on the whole batch of the same inputs."""
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "loop", "handoff_worker.py")
sys.path.insert(0, os.path.dirname(WORKER))
from handoff_worker import B, CONFIGS, MINI_BATCHES, PROMPT, RESPONSE, config, whole_batch  # noqa: E402

T = PROMPT + RESPONSE
N_FIELDS = 13  # TrainBatch.TENSOR_FIELDS
TRAILING = 2  # routed_experts' [layers, topk] (0s when not set)
HEADER = 8 * (4 + N_FIELDS + TRAILING + 4 * MINI_BATCHES)  # int64: counts, shape, dtype codes, dims, mini-batch layout
# bytes per row of what the main rank sends: per token tokens (int64) + loss_mask, advantages,
# rollout_logprobs (float32); per row lengths, group_ids, weight_versions (int64) + rewards (float32)
SENT_PER_TOKEN, SENT_PER_ROW = 8 + 4 + 4 + 4, 8 + 8 + 8 + 4
# held after the passes: the sent per-token tensors + old and reference log-probs (float32), and with
# the critic its values and returns (float32)
HELD_PER_TOKEN = {"grpo": SENT_PER_TOKEN + 4 + 4, "kl_in_reward": SENT_PER_TOKEN + 4 + 4,
                  "gae": SENT_PER_TOKEN + 4 + 4 + 4 + 4}
# the configs whose advantages every rank computes on its share (the others: the main rank, whole batch)
ON_SHARES = ("kl_in_reward", "gae")
# for those, every rank but the main one receives the whole batch's rewards (float32) and group ids
# (int64), and every rank, when there are several, the whitening's three all-reduces of float64:
# (-min, max), (count, sum), centred sum of squares
SEQUENCES = B * (4 + 8)
REDUCTIONS = 8 * (2 + 2 + 1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(model_dir: str, out: str, world: int, timeout: float = 120.0) -> list[dict]:
    """handoff_worker.py on ``world`` gloo ranks (a fresh port, OMP_NUM_THREADS=1); every rank's results."""
    os.makedirs(out, exist_ok=True)
    port = free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=ROOT,
                   TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
        log = open(os.path.join(out, f"rank{r}.log"), "w")
        procs.append((subprocess.Popen([sys.executable, WORKER, model_dir, out], env=env, cwd=ROOT, stdout=log,
                                       stderr=subprocess.STDOUT), log))
    deadline = time.time() + timeout
    try:
        for p, _ in procs:
            p.wait(timeout=max(deadline - time.time(), 1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    logs = "\n".join(open(os.path.join(out, f"rank{r}.log")).read()[-2000:] for r in range(world))
    assert all(p.returncode == 0 for p, _ in procs), f"world {world}: {[p.returncode for p, _ in procs]}\n{logs}"
    return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    sys.path.insert(0, ROOT)
    from tests.conftest import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("handoff_model")))


@pytest.fixture(scope="module")
def worlds(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("handoff")
    return {w: run_world(model, str(root / f"w{w}"), w) for w in (1, 2, 4)}


def received_bytes(name: str, w: int, r: int, n: int) -> int:
    """What rank ``r`` of ``w`` receives in the step of config ``name`` (its share has ``n`` rows)."""
    share = 0 if r == 0 else HEADER + n * (T * SENT_PER_TOKEN + SENT_PER_ROW)
    if name not in ON_SHARES:
        return share
    return share + (0 if r == 0 else SEQUENCES) + (REDUCTIONS if w > 1 else 0)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_each_rank_receives_and_holds_its_share_only(worlds, name):
    held_per_token = HELD_PER_TOKEN[name]
    for w, ranks in worlds.items():
        n = B // w  # each mini-batch of B / MINI_BATCHES rows splits evenly over w ranks
        for r, res in enumerate(ranks):
            got = res[name]
            assert got["shape"] == (n, T)
            assert got["per_token_bytes"] == n * T * held_per_token, (w, r)
            assert got["metrics"]["handoff/per_token_bytes"] == got["per_token_bytes"]
            assert got["metrics"]["handoff/per_token_bytes_max"] == n * T * held_per_token
            received = received_bytes(name, w, r, n)
            assert got["received"] == received, (name, w, r, got["received"], received)
            assert got["metrics"]["handoff/bytes_received"] == received
    # what a rank other than the main one receives of the share falls as 1/DP (the header and the
    # whole batch's rewards, group ids and reductions aside)
    one = [worlds[w][1][name]["received"] - received_bytes(name, w, 1, 0) for w in (2, 4)]
    assert one[0] == 2 * one[1]
    held = [worlds[w][-1][name]["per_token_bytes"] for w in (1, 2, 4)]
    assert held == [held[0], held[0] // 2, held[0] // 4]


@pytest.mark.parametrize("name", ON_SHARES)
def test_the_main_rank_receives_no_per_token_data_for_share_advantages(worlds, name):
    """Before, the main rank gathered the shares' [n, T] log-probs / values ((w - 1) B / w rows of
    them): 320 and 480 bytes at 2 and 4 ranks for the KL's two float32 fields. Now 0, 40, 40."""
    assert [worlds[w][0][name]["received"] for w in (1, 2, 4)] == [0, REDUCTIONS, REDUCTIONS]


def whole_batch_reference(model, name, ranks):
    """One process's advantages and returns of the whole batch whose rows' per-token inputs (old and
    reference log-probs, values) are the ones the ranks computed, and the (local-only) advantages a
    rank would get by whitening its share by itself."""
    from megaforge.data.batch import set_denominators
    from megaforge.driver.steps import batch_advantages

    from megaforge.build import RunBuilder

    cfg = RunBuilder(config(model, CONFIGS[name])).step_settings()
    whole = set_denominators(whole_batch())
    for field in ("old_logprobs", "ref_logprobs", "values"):
        if ranks[0][name][field] is not None:
            setattr(whole, field, torch.zeros(B, T))
            for res in ranks:
                getattr(whole, field)[torch.tensor(res[name]["rows"])] = res[name][field]
    local = []
    for res in ranks:
        part = whole.select(res[name]["rows"])
        local.append(batch_advantages(part, cfg))
    return batch_advantages(whole, cfg), whole.returns, local


@pytest.mark.parametrize("name", ON_SHARES)
def test_share_advantages_equal_the_whole_batch_computation(model, worlds, name):
    """Each rank's advantages (and the critic's returns) equal one process's computation on the
    whole batch of the same per-token inputs. The rows' token work is the same float32 arithmetic
    per row; the whitening's float64 count / sum / centred sum of squares add up the shares' partials
    (2 or 4 of them, 48 trained tokens) in another order, ~1e-15 relative, so the float32 results may
    differ by an ulp of the cast: rtol 2.5e-7 (2 ulps), atol 1e-7 for values near 0. A rank that
    whitened only its own share would be off by far more (checked: > 1e-3)."""
    for w in (1, 2, 4):
        adv, returns, local = whole_batch_reference(model, name, worlds[w])
        for r, res in enumerate(worlds[w]):
            got, rows = res[name], torch.tensor(res[name]["rows"])
            torch.testing.assert_close(got["advantages"], adv[rows], rtol=2.5e-7, atol=1e-7, msg=f"{name} w{w} r{r}")
            if returns is not None:
                torch.testing.assert_close(got["returns"], returns[rows], rtol=2.5e-7, atol=1e-7)
            if w > 1:
                assert float((local[r] - adv[rows]).abs().max()) > 1e-3, (name, w, r)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_results_are_those_of_one_process(worlds, name):
    """The rows' log-probs, values, advantages and returns on their ranks equal one process's rows;
    the step's metrics (sums over ranks) equal one process's. Tolerances: float32 log-probs / values of
    the same rows computed in micro-batches of other rows (batched matmuls may round differently:
    ~1e-6 relative over the 2-layer model's few hundred accumulations, and what follows from them),
    and metrics summed over up to 4 ranks in another order (float32, relative 1e-5)."""
    ref = worlds[1][0][name]
    for w in (2, 4):
        for res in worlds[w]:
            got = res[name]
            rows = torch.tensor(got["rows"])
            for field in ("old_logprobs", "ref_logprobs", "values", "advantages", "returns"):
                if ref[field] is not None:
                    torch.testing.assert_close(got[field], ref[field][rows], rtol=1e-5, atol=1e-5, msg=field)
            for k in ("loss", "pg_loss", "grad_norm", "entropy", "kl"):
                assert got["metrics"][k] == pytest.approx(ref["metrics"][k], rel=1e-5, abs=1e-6), (w, k)


def test_a_dp_rank_of_several_model_parallel_peers_is_summed_once(worlds):
    """Pairs of ranks as one DP rank each (the worker's ``peers``): batch_sum over the DP ranks of
    (1, dp_rank) gives (DP size, 0 + 1 + ...), not twice that; exact in float64 (small integers)."""
    assert [res["peer_sums"] for res in worlds[1]] == [[1.0, 0.0]]
    assert [res["peer_sums"] for res in worlds[2]] == [[1.0, 0.0]] * 2
    assert [res["peer_sums"] for res in worlds[4]] == [[2.0, 1.0]] * 4


def test_a_batch_too_small_for_the_ranks_fails_on_every_rank(worlds):
    """2 w - 1 rows in 2 mini-batches: the second has w - 1 rows, one short of feeding w ranks (one
    process: a single row cannot make 2 mini-batches)."""
    for w, ranks in worlds.items():
        want = (f"a mini-batch of {w - 1} sequences cannot feed {w} data-parallel ranks" if w > 1
                else "trainer.mini_batches=2 exceeds the batch of 1 sequences")
        assert [res["too_small"] is not None and want in res["too_small"] for res in ranks] == [True] * w, w


def test_shares_partition_every_mini_batch():
    """Uneven sizes: 7 rows, 2 mini-batches (4 + 3 rows), 2 DP ranks. Each rank's share holds its
    rows of every mini-batch, and the whole mini-batch's counts (the loss's denominators)."""
    from megaforge.data.batch import samples_to_batch, share_mini_batches, share_of, share_rows
    from megaforge.types import Sample

    samples = [Sample(prompt_ids=[3] * (1 + i % 2), response_ids=[4] * i, rollout_logprobs=[-0.5] * i, group_id=i // 2)
               for i in range(7)]
    whole = samples_to_batch(samples, pad_id=0)
    assert [share_rows(7, 2, d, 2) for d in (0, 1)] == [[0, 1, 4, 5], [2, 3, 6]]
    minis = [[(m.batch_size, m.num_tokens, m.num_seqs) for m in share_mini_batches(share_of(whole, 2, d, 2))]
             for d in (0, 1)]
    # mini-batch 0: rows 0-3 (0 + 1 + 2 + 3 = 6 trained tokens, 3 rows with one); 1: rows 4-6 (15, 3)
    assert minis == [[(2, 6, 3), (2, 15, 3)], [(2, 6, 3), (1, 15, 3)]]
    share = share_of(whole, 2, 1, 2)
    assert torch.equal(share.tokens, whole.select([2, 3, 6]).tokens)  # trimmed to its longest row
    with pytest.raises(ValueError, match="a mini-batch of 3 sequences cannot feed 4 data-parallel ranks"):
        share_of(whole, 2, 0, 4)


def test_select_takes_consecutive_rows_as_views_and_other_rows_as_copies():
    """One DP rank's share is every row (share_rows(n, m, 0, 1) == 0..n-1): TrainBatch.select takes a list or
    range of consecutive ascending rows as a slice, so the share's fields are views of the batch's (no gathered
    copy of each [B, T] field on the host), with the same values as the gathered rows; any other list is
    gathered as before."""
    from megaforge.data.batch import samples_to_batch, share_of, share_rows
    from megaforge.types import Sample

    samples = [Sample(prompt_ids=[3, 5], response_ids=[4] * (i + 1), rollout_logprobs=[-0.5] * (i + 1), group_id=i // 2)
               for i in range(6)]
    whole = samples_to_batch(samples, pad_id=0)
    assert share_rows(6, 2, 0, 1) == list(range(6))
    share = share_of(whole, 2, 0, 1)
    assert share.tokens.data_ptr() == whole.tokens.data_ptr() and torch.equal(share.tokens, whole.tokens)
    for rows in ([1, 2, 3], range(1, 4)):  # rows 1-3, trimmed to row 3's 2 + 4 tokens
        part = whole.select(rows)
        gathered = whole.select(torch.tensor([1, 2, 3]))
        assert part.tokens.untyped_storage().data_ptr() == whole.tokens.untyped_storage().data_ptr()
        assert part.tokens.shape == (3, 6) and all(torch.equal(getattr(part, f), getattr(gathered, f))
                                                   for f in ("tokens", "lengths", "loss_mask", "rollout_logprobs"))
    apart = whole.select([0, 2, 4])  # not consecutive: a copy
    assert apart.tokens.untyped_storage().data_ptr() != whole.tokens.untyped_storage().data_ptr()
    assert apart.lengths.tolist() == [3, 5, 7] and whole.select([2, 1]).lengths.tolist() == [5, 4]


def test_an_estimator_not_declared_for_shares_is_refused_on_several_ranks(model):
    """A plug-in estimator (``package.module:callable``: no declarations) may reduce over the rows it
    is given, which on a share would be the share's statistics: with several DP ranks and advantages
    computed on the shares, the step stops naming it, before any collective (one process here)."""
    from megaforge.build import RunBuilder
    from megaforge.driver.handoff import BatchHandOff
    from megaforge.driver.steps import share_advantages

    cfg = config(model, {"grpo": {"beta": 0.01}, "algo": {
        "advantage": "megaforge.algorithms.advantages:reinforce_pp_advantage", "kl_in_reward": True}})
    share = whole_batch()
    with pytest.raises(ValueError, match="reinforce_pp_advantage' does not declare that it can .*shares=True"):
        share_advantages(BatchHandOff(0, 2, MINI_BATCHES), share, None, RunBuilder(cfg).step_settings())
