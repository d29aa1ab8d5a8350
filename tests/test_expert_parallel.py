"""Expert parallelism on gloo (CPU): the owner map; 2 and 4 ranks give one process's greedy
tokens and bit-identical logits, each rank asking its provider for its shard only; a rank
that dies makes the others exit with one line, within the collective timeout.

Spawned ranks are few and short (process start dominates): one spawn of 4 ranks runs the
4-rank generation and, on a subgroup of ranks 0 and 1, the 2-rank one."""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import replace
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from streamrt.backends.torch_backend import TorchBackend
from streamrt.checkpoint.reader import open_tree
from streamrt.checkpoint.synth import synth
from streamrt.config import load_config
from streamrt.generate import generate
from streamrt.loader import DictExpertProvider, DirectExpertProvider, load_model
from streamrt.model import KimiLinearForCausalLM, run_sync
from streamrt.model.lockstep import lockstep
from streamrt.model.synthetic import init_random_, random_experts
from streamrt.parallel import ExpertOwners, ExpertParallelBackend, Remote, ShardExperts, ShardPredictor, shard
from streamrt.parallel.group import Ranks, exit_one_line, init_group, spawn
from streamrt.parallel.launch import Job, generate_on, rank_model
from streamrt.plan.shards import plan_ranks, projected_s_per_token
from streamrt.runtime.options import RuntimeOptions
from streamrt.runtime.predictor import Predictor
from streamrt.runtime.scheduler import StreamingRuntime
from streamrt.store.keys import ExpertKey

JOB = Job("tiny-k3.1-pro", prompt=tuple(b"expert"), max_new_tokens=4, seed=5, timeout_s=20.0)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)  # -0.0 and +0.0 differ here


# ---- the owner map -----------------------------------------------------------------------


@pytest.mark.parametrize("moe_layers,E", [((1, 2, 3, 4, 5, 6, 7, 8), 32), ((3, 5, 9), 7), ((0,), 5)])
def test_owner_map_deals_every_expert_once_balanced(moe_layers, E):
    for world in range(1, min(E, 6) + 1):
        owners = ExpertOwners(moe_layers, E, world)
        again = ExpertOwners(moe_layers, E, world)
        per_rank = {r: [ExpertKey(l, e) for l in moe_layers for e in owners.experts_of(l, r)] for r in range(world)}
        every = sorted(k for keys in per_rank.values() for k in keys)
        assert every == [ExpertKey(l, e) for l in moe_layers for e in range(E)]  # each owned exactly once
        for r, keys in per_rank.items():
            assert all(owners.rank_of(*k) == r == again.rank_of(*k) and owners.owns(r, k) for k in keys)
        for l in moe_layers:
            n = [len(owners.experts_of(l, r)) for r in range(world)]
            assert max(n) - min(n) <= 1  # each layer balanced
            assert owners.table[l].tolist() == [owners.rank_of(l, e) for e in range(E)]
        totals = [owners.counts(r) for r in range(world)]
        assert max(totals) - min(totals) <= 1  # and the whole model


def test_owner_map_is_the_stated_rule():
    owners = ExpertOwners((4, 6), 5, 2)  # (m * E + e) mod N
    assert owners.experts_of(4, 0) == [0, 2, 4] and owners.experts_of(6, 0) == [1, 3]
    assert ExpertOwners((1, 2), 32, 4).experts_of(2, 1) == list(range(1, 32, 4))
    with pytest.raises(Exception, match="would own none"):
        ExpertOwners((1,), 4, 5)


# ---- in one process ---------------------------------------------------------------------


def _plain(cfg_name="tiny-k3.1-pro", seed=JOB.seed):
    cfg = load_config(cfg_name)
    model = KimiLinearForCausalLM(cfg, backend=TorchBackend()).eval().requires_grad_(False)
    init_random_(model, seed)
    return cfg, model, random_experts(cfg, seed + 1)


def _recording(provider, store: list):
    def runner(gen):
        out = run_sync(gen, provider)
        store.append(out)
        return out
    return runner


def _reference(job: Job = JOB):
    cfg, model, experts = _plain(job.model, job.seed)
    prov, logits = DictExpertProvider(experts, record=True), []
    res = generate(
        model, list(job.prompt), runner=_recording(prov, logits), max_new_tokens=job.max_new_tokens, hash_steps=True
    )
    return res, logits, prov.requests


def test_predictor_guesses_only_the_shard_with_fixed_shapes():
    cfg, model, _ = _plain()
    inner = Predictor.from_model(model)
    owners = ExpertOwners.for_config(cfg, 4)
    hidden = torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    layer = cfg.moe_layers[0]
    nxt = inner.target(layer)
    for rank in range(4):
        p = ShardPredictor(inner, owners, rank)
        full = inner.predict(layer, hidden).reshape(-1).tolist()
        got = p.predict(layer, hidden).tolist()
        assert len(got) == len(full)  # no data-dependent shape: nothing waits for the device
        mine = [e for e in full if owners.rank_of(nxt, e) == rank]
        distinct = list(dict.fromkeys(got))
        assert all(owners.rank_of(nxt, e) == rank for e in distinct)
        assert distinct == list(dict.fromkeys(mine)) or (not mine and len(distinct) == 1)


def test_one_rank_through_the_distributed_path_is_the_plain_path(tmp_path):
    ref, ref_logits, _ = _reference()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=20))
    try:
        logits = []
        model, prov, owners, prompt = rank_model(JOB, 0, 1, dist.group.WORLD)
        runner = _recording(prov, logits)
        res = generate(model, prompt, runner=lambda g: runner(shard(g, owners, 0)), max_new_tokens=JOB.max_new_tokens,
                       hash_steps=True)
    finally:
        dist.destroy_process_group()
    assert res.tokens == ref.tokens and res.step_hashes == ref.step_hashes
    assert len(logits) == len(ref_logits) and all(torch.equal(bits(a), bits(b)) for a, b in zip(logits, ref_logits))
    assert model.backend.pairs > 0


def test_an_unwrapped_backend_is_told_where_the_expert_lives():
    cfg, model, experts = _plain()
    owners = ExpertOwners.for_config(cfg, 2)
    prov = DictExpertProvider({k: v for k, v in experts.items() if owners.rank_of(*k) == 0})
    with pytest.raises(Exception, match=r"lives on rank 1: run the model on an ExpertParallelBackend"):
        run_sync(shard(model.forward_steps(torch.tensor(list(b"abc")), model.new_cache()), owners, 0), prov)


def test_a_lockstep_of_forwards_shards_like_one(tmp_path):
    """shard(lockstep([...])): the server's step, one request per layer for every forward; each
    forward's logits are the plain ones (lockstep's share of the answer keeps is_local)."""
    cfg, plain, experts = _plain()
    prompts = [torch.tensor([list(b"one")]), torch.tensor([list(b"second")])]
    want = [
        run_sync(plain.forward_steps(p, plain.new_cache(1), last_only=True), DictExpertProvider(experts))
        for p in prompts
    ]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=20))
    try:
        model, prov, owners, _ = rank_model(JOB, 0, 1, dist.group.WORLD)
        gens = [model.forward_steps(p, model.new_cache(1), last_only=True) for p in prompts]
        got = run_sync(shard(lockstep(gens), owners, 0), prov)
    finally:
        dist.destroy_process_group()
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, want, strict=True))


def test_a_pair_no_rank_computed_is_an_error_at_the_next_layer(tmp_path):
    """The all-reduce also sums each rank's pair count: a layer where the ranks did not compute
    every (row, slot) pair exactly once is refused (checked one call later: no device sync)."""
    cfg, _, experts = _plain()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=20))
    try:
        be = ExpertParallelBackend(TorchBackend(), dist.group.WORLD)
        layer, Dl = cfg.moe_layers[0], cfg.routed_expert_hidden_size
        ids, w, z = torch.tensor([[0, 1], [2, 0]]), torch.rand(2, 2), torch.randn(2, Dl)
        whole = ShardExperts({e: experts[(layer, e)] for e in (0, 1, 2)}, {}, ids, layer)
        alone = TorchBackend().expert_ffn(z, ids, w, {e: experts[(layer, e)] for e in (0, 1, 2)}, 4.0, 25.0)
        assert torch.equal(bits(be.expert_ffn(z, ids, w, whole, 4.0, 25.0)), bits(alone))
        holed = ShardExperts({e: experts[(layer, e)] for e in (0, 1)}, {2: Remote(layer, 2, 1)}, ids, layer)
        be.expert_ffn(z, ids, w, holed, 4.0, 25.0)
        with pytest.raises(Exception, match=rf"layer {layer}: the ranks computed 3 expert pairs of 4"):
            be.expert_ffn(z, ids, w, whole, 4.0, 25.0)
    finally:
        dist.destroy_process_group()


# ---- several ranks (spawned) --------------------------------------------------------------


def _streamed_run(rank, group, tree_dir):
    """Ranks 0 and 1 of `group`, each on its own StreamingRuntime (host tier, device slots,
    staging of its shard's guesses): what the scheduler served, held and staged."""
    tree = open_tree(tree_dir)
    model = load_model(tree, "cpu", dtype=None, backend=ExpertParallelBackend(TorchBackend(), group, rank=rank))
    owners = ExpertOwners.for_config(tree.config, 2)
    pred = ShardPredictor(Predictor.from_model(model), owners, rank)
    logits = []
    with StreamingRuntime(tree, model, RuntimeOptions(device="cpu", gpu_experts=6), predictor=pred, workers=1,
                          record_trace=True) as rt:
        def runner(gen):
            logits.append(rt.run(shard(gen, owners, rank)))
            return logits[-1]
        res = generate(model, list(JOB.prompt), runner=runner, max_new_tokens=JOB.max_new_tokens, hash_steps=True)
        return {
            "tokens": res.tokens,
            "logits": logits,
            "served": rt.stats.trace,
            "resident": [tuple(k) for k in rt.gpu.keys()],
            "staged": rt.stats.staged,
        }


def _ranks_worker(rank, world, addr, port, out_dir, tree_dir):
    """4 ranks: a 2-rank run on the subgroup {0, 1} (a provider, then the streaming runtime),
    then a 4-rank run; each saves what it saw."""
    torch.set_num_threads(1)
    init_group(Ranks(rank, world, rank, addr, port), JOB.timeout_s, torch.device("cpu"))
    pair = dist.new_group([0, 1], timeout=timedelta(seconds=JOB.timeout_s))
    runs = [(2, pair)] if rank < 2 else []
    runs.append((4, dist.group.WORLD))
    for n, group in runs:
        built = rank_model(JOB, rank, n, group)
        logits, prov = [], built[1]
        runner = _recording(prov, logits)
        res = generate(built[0], built[3], runner=lambda g: runner(shard(g, built[2], rank)),
                       max_new_tokens=JOB.max_new_tokens, hash_steps=True)
        asked = [(r.layer, r.ids.reshape(-1).tolist()) for r in prov.requests]
        held = sorted(prov.experts)
        torch.save({"tokens": res.tokens, "hashes": res.step_hashes, "logits": logits, "asked": asked, "held": held},
                   os.path.join(out_dir, f"n{n}_r{rank}.pt"))
        if n == 2:
            torch.save(_streamed_run(rank, group, tree_dir), os.path.join(out_dir, f"streamed_r{rank}.pt"))
    dist.destroy_process_group()


def test_two_and_four_ranks_match_one_process_bit_for_bit(tmp_path):
    t0 = time.monotonic()
    tree_dir = tmp_path / "tree"
    synth("tiny-k3.1-pro", tree_dir, fmt="streamrt", seed=0, workers=1, progress=False)
    codes = spawn(_ranks_worker, 4, (str(tmp_path), str(tree_dir)), timeout_s=JOB.timeout_s)
    assert codes == [0, 0, 0, 0]
    _check_streamed(tmp_path, open_tree(tree_dir))
    ref, ref_logits, ref_requests = _reference()
    for n in (2, 4):
        got = [torch.load(tmp_path / f"n{n}_r{r}.pt") for r in range(n)]
        owners = ExpertOwners.for_config(load_config(JOB.model), n)
        for r, g in enumerate(got):
            assert g["tokens"] == ref.tokens and g["hashes"] == ref.step_hashes
            assert all(torch.equal(bits(a), bits(b)) for a, b in zip(g["logits"], ref_logits, strict=True))
            assert all(owners.rank_of(*k) == r for k in g["held"])  # a rank holds its shard only
            assert len(g["asked"]) == len(ref_requests)
        for i, req in enumerate(ref_requests):  # every request: the ranks asked for disjoint shards of it
            asked = [g["asked"][i] for g in got]
            assert all(layer == req.layer for layer, _ in asked)
            flat = [e for _, ids in asked for e in ids]
            assert sorted(flat) == req.unique_ids()
            assert all(owners.rank_of(req.layer, e) == r for r, (_, ids) in enumerate(asked) for e in ids)
    assert time.monotonic() - t0 < 60


def _check_streamed(out_dir, tree):
    """Two ranks on their own streaming runtimes: one process's tokens and logits bit for bit;
    each served, kept on its device tier and staged only experts it owns."""
    model = load_model(tree, "cpu", dtype=None)
    logits = []
    ref = generate(model, list(JOB.prompt), runner=_recording(DirectExpertProvider(tree), logits),
                   max_new_tokens=JOB.max_new_tokens, hash_steps=True)
    owners = ExpertOwners.for_config(tree.config, 2)
    got = [torch.load(out_dir / f"streamed_r{r}.pt") for r in range(2)]
    for r, g in enumerate(got):
        assert g["tokens"] == ref.tokens
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(g["logits"], logits, strict=True))
        assert g["served"] and all(owners.rank_of(layer, e) == r for layer, ids in g["served"] for e in ids)
        assert all(owners.rank_of(*key) == r for key in g["resident"])
        assert g["staged"] > 0
    assert any(not ids for g in got for _, ids in g["served"])  # a layer where a rank owned none of the routed


def _dying_worker(rank, world, addr, port, out_dir, how):
    """At its third expert request rank 1 is killed (SIGKILL), or stops answering for longer
    than the collective timeout; rank 0 must exit on one line either way."""
    torch.set_num_threads(1)
    err = os.open(os.path.join(out_dir, f"stderr{rank}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(err, 2)
    sys.stderr = os.fdopen(2, "w", buffering=1)

    def work():
        group = init_group(Ranks(rank, world, rank, addr, port), 5.0, torch.device("cpu"))
        built = rank_model(replace(JOB, timeout_s=5.0), rank, world, group)
        prov, calls = built[1], []

        def provider(req):
            calls.append(req.layer)
            if rank == 1 and len(calls) == 3:
                if how == "killed":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(8.0)  # 5 s timeout: rank 0 gives up first
                os._exit(0)
            return prov(req)

        with open(os.path.join(out_dir, f"t{rank}"), "w") as f:
            f.write(str(time.time()))
        generate_on(JOB, rank, world, group, built=(built[0], provider, built[2], built[3]))

    exit_one_line(work, rank)


@pytest.mark.parametrize("how", ["killed", "silent"])
def test_a_dead_rank_makes_the_others_exit_with_one_line(tmp_path, how):
    codes = spawn(_dying_worker, 2, (str(tmp_path), how), timeout_s=5.0, grace_s=10.0)
    done = time.time()
    assert codes == [2, -signal.SIGKILL if how == "killed" else 0]
    lines = (tmp_path / "stderr0").read_text().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("streamrt: rank 0: expert all-reduce of layer ") and "another rank died" in lines[0]
    said = (tmp_path / "stderr0").stat().st_mtime  # when rank 0 wrote its line
    assert said - float((tmp_path / "t0").read_text()) < 5.0 + 3.0  # within the timeout, not a hang
    assert done - said < 10.0


def test_rank_plan_splits_the_experts_and_each_link_carries_its_share():
    cfg = load_config("kimi-k3.1-pro")
    one_card, [alone] = plan_ranks(cfg, 141 << 30, 1)
    assert alone.link_bytes_per_token == pytest.approx(one_card.link_bytes_per_token(cfg))
    _, eight = plan_ranks(cfg, 141 << 30, 8)
    assert sum(r.experts for r in eight) == cfg.expert_files
    assert sum(r.expert_bytes_per_token for r in eight) == pytest.approx(alone.expert_bytes_per_token)
    # a shard of 1/8 with the same slots hits more: each link carries less than 1/8 of one link's bytes
    assert all(r.link_bytes_per_token < alone.link_bytes_per_token / 8 for r in eight)
    proj = projected_s_per_token(cfg, eight, 55.0, 4800.0)
    assert proj["s_per_token"] < projected_s_per_token(cfg, [alone], 55.0, 4800.0)["s_per_token"] / 5


def test_run_gpus_2_answers_as_one_process(capfd):
    """`streamrt run --gpus 2` on the embedded model: the same reply and logits hash (prefill and
    every decode step) as `streamrt run`; rank 1 prints nothing."""
    import json

    from streamrt.cli.main import main

    argv = ["run", "--prompt", "The capital of Spain", "--max-new-tokens", "6", "--json", "--device", "cpu"]
    assert main(argv) == 0
    alone = json.loads(capfd.readouterr().out)
    assert main(argv + ["--gpus", "2"]) == 0
    out = capfd.readouterr().out.strip().splitlines()
    assert len(out) == 1
    two = json.loads(out[0])
    assert two["stats"]["logits_hash"] == alone["stats"]["logits_hash"] and two["thinking"] == alone["thinking"]


def test_gpus_flag_is_checked_before_any_rank_starts():
    from streamrt.errors import StreamrtError
    from streamrt.parallel.launch import check_gpus

    assert check_gpus("2") == 2
    for bad, words in (("abc", "expected a process count"), ("0", "must be >= 1"), ("99999", "at most|GPUs")):
        with pytest.raises(StreamrtError, match=words):
            check_gpus(bad)


def test_inspect_gpus_prints_each_ranks_share_and_refuses_without_a_card_size(capsys):
    from streamrt.cli.main import main

    assert main(["inspect", "kimi-k3.1-pro", "--gpus", "8", "--gpu-mem", "141G"]) == 0
    out = capsys.readouterr().out
    assert "experts sharded (m * E + e) mod 8" in out and out.count("| 10,304 |") == 8
    assert main(["inspect", "kimi-k3.1-pro", "--gpus", "8"]) == 2
    assert "give --gpu-mem too" in capsys.readouterr().err
