"""`Session`: a loaded model, what `streamrt run` and `streamrt selfcheck` need from the runtime
(tokenizer, generate with a per-token callback, last-position logits of a prompt), the real one
on a converted tree (tree -> model -> StreamingRuntime -> generate), and which tree `--model`
names.
"""

from __future__ import annotations

import hashlib
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Generator

from streamrt.chat import ChatProfile
from streamrt.checkpoint.dst import STATE_DIR, recorded_source
from streamrt.output_paths import human_bytes
from streamrt.errors import StreamrtError
from streamrt.api.sampling import Sampling
from streamrt.tokenizer import Tokenizer

if TYPE_CHECKING:
    from streamrt.runtime.options import RuntimeOptions


def resolve_model_dir(model: str | None, notice: Callable[[str], None]) -> Path:
    """The streamrt tree to run: `--model DIR`, checked here so the error names the directory."""
    if model is None:
        from streamrt.default_model import default_model_dir

        return default_model_dir(notice)
    if not model.strip():  # an unset shell variable: Path("") is the current directory
        raise StreamrtError("--model is empty; give a converted streamrt tree")
    path = Path(model).expanduser()
    try:
        if not path.exists():
            raise StreamrtError(f"--model {model}: no such directory")
        if not path.is_dir():
            raise StreamrtError(f"--model {model}: not a directory (give a converted streamrt tree)")
        if (path / "manifest.json").exists() and not (path / "manifest.json").is_file():
            raise StreamrtError(f"--model {model}: manifest.json is not a file")
        release = (path / "config.json").is_file()
        tree = (path / "manifest.json").is_file()
    except OSError as e:  # e.g. a name longer than the file system allows
        raise StreamrtError(f"--model {model}: {e.strerror or e}") from None
    if not tree:
        if (path / STATE_DIR).is_dir():
            raise StreamrtError(f"--model {model}: an unfinished conversion (no manifest.json yet); finish it: "
                                f"streamrt convert {shlex.quote(recorded_source(path) or 'SRC')} {shlex.quote(model)}")
        if (path / "experts").is_dir() or (path / "dense").is_dir():
            raise StreamrtError(f"--model {model}: manifest.json is missing from this converted tree (its dense/ "
                                "and experts/ are here, so it was damaged or copied in part); convert again into "
                                "an empty directory: streamrt convert SRC NEW_DIR")
        if release:
            raise StreamrtError(f"--model {model}: a release checkpoint, not a streamrt tree; convert it first: "
                                f"streamrt convert {model} OUT_DIR")
        raise StreamrtError(f"--model {model}: no manifest.json (not a converted streamrt tree)")
    return path


@dataclass
class GenStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    stop: str = "length"  # "stop" (a stop token) or "length" (--max-new-tokens)
    hits: dict = field(default_factory=dict)  # e.g. {"device": 0.41, "host": 0.98}
    logits_hash: str = ""  # over the prefill's and every decode step's logits: any divergence shows
    cached_tokens: int = 0  # prompt tokens resumed from the prefix cache (not prefilled again)

    @property
    def decode_rate(self) -> float:
        # The first new token comes from the prefill; the decode steps make the rest.
        return max(0, self.new_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    def line(self) -> str:
        hits = ", ".join(f"{k} {v:.1%}" for k, v in self.hits.items()) or "n/a"
        cached = f" ({self.cached_tokens} cached)" if self.cached_tokens else ""
        return (
            f"{self.new_tokens} tokens, {self.decode_rate:.2f} tok/s decode; prefill {self.prompt_tokens} tokens"
            f"{cached} in {self.prefill_s:.2f} s; expert hit rate: {hits}"
        )


class Session:
    """A loaded model: what `run` and `selfcheck` need from the runtime."""

    name: str
    tokenizer: Tokenizer
    chat: ChatProfile = ChatProfile()  # the framing the model was trained with (its tree says)
    context: int | None = None  # the model's context (max_position_embeddings), None: unchecked

    def generate(self, ids: list[int], sampling: Sampling, on_token: Callable[[int], None]) -> GenStats:
        raise NotImplementedError

    def tokens(self, ids: list[int], sampling: Sampling) -> Generator[int, None, GenStats]:
        """`generate` as an iterator: each token as it is drawn; returns the GenStats."""
        raise NotImplementedError

    def control_logits(self, ids: list[int]):
        """fp32 logits [V] of the last prompt position, from a fresh state."""
        raise NotImplementedError

    def load(self) -> None:
        """Load the weights now (generate and control_logits load on first use)."""

    def close(self) -> None:
        pass


def open_session(model_dir: Path, options: RuntimeOptions, *, progress: bool,
                 prefill_chunk: int | None = None) -> Session:
    """The model session on `model_dir` (prefill_chunk: tokens per prefill chunk, None: from free
    memory). Under torchrun, or as a rank `run --gpus N` spawned (RANK / WORLD_SIZE set): this
    rank's part of an expert-parallel run (streamrt.parallel)."""
    from streamrt.parallel.group import Ranks

    ranks = Ranks.from_env()
    return _ModelSession(model_dir, options, progress=progress and (ranks is None or ranks.rank == 0), ranks=ranks,
                         prefill_chunk=prefill_chunk)


class _ModelSession(Session):
    """The real runtime: tree -> model -> StreamingRuntime (host + device tiers) -> generate.

    Opening reads only the tree's manifest, config and tokenizer and checks the flags against
    them (device, slot and memory budgets); the weights load on `load()` (first generate), so a
    prompt longer than the context, or a budget the tree cannot meet, is refused before any."""

    def __init__(self, model_dir: Path, options: RuntimeOptions, *, progress: bool, ranks=None,
                 prefill_chunk: int | None = None):
        from streamrt.checkpoint.reader import open_tree
        from streamrt.tokenizer import load_tokenizer

        self.options = options
        self._prefill_chunk, self._progress, self._ranks, self._loaded = prefill_chunk, progress, ranks, False
        self.runtime, self.ep = None, None
        self.prefix = options.make_prefix_cache()  # snapshots of prefilled prompts, across calls
        self._graphs_said = None  # the graphs_line last printed: said once, not after every reply
        tree = open_tree(model_dir)
        tree.check_side_files()
        _check_outputs_outside(tree, self.options)
        self.tree = tree
        self.name = tree.config.name
        self.tokenizer = load_tokenizer(tree.root, tree.config.vocab_size, tree.config.eos_token_id)
        self.chat = ChatProfile.from_tree(tree.root)
        self.context = tree.config.max_position_embeddings
        self._device = None
        if ranks is None:  # a rank's device and slots come from its group, in load()
            from streamrt.loader import dense_placement
            from streamrt.runtime.streams import make_device

            self._device = make_device(self.options.device)
            if self.options.gpu_mem is not None and self._device.kind != "cuda":
                print(f"streamrt: --gpu-mem on the CPU (no CUDA device in use): it only sizes the placement plan "
                      f"and expert slots as for a card of {human_bytes(self.options.gpu_mem)}", file=sys.stderr)
            if self.options.backend != "torch" and self._device.kind != "cuda":
                self.options.make_backend(self._device)  # the one-line refusal, before any weights
            # the runtime's own sizing (StreamingRuntime), on the plan load_placed will make
            plan = dense_placement(tree.config, self.options.gpu_mem, self._device)
            self.options.with_plan(plan).resolve(tree.config, tree.layout.file_bytes, self._device)

    def load(self) -> None:
        if self._loaded:
            return
        from streamrt.loader import load_placed
        from streamrt.plan.placement import format_plan
        from streamrt.runtime.scheduler import StreamingRuntime
        from streamrt.runtime.streams import make_device

        tree, ranks = self.tree, self._ranks
        with _LoadBar(enabled=self._progress, desc=f"loading {tree.root.name}", total=2) as bar:
            bar.step("dense weights")
            self.ep = None  # expert parallelism: this rank's shard and its all-reduce (streamrt.parallel)
            if ranks is not None:
                from streamrt.parallel.rank import ExpertParallel

                self.ep = ExpertParallel.for_options(ranks, tree.config, self.options)
                self.options = self.ep.rank_options(self.options)
            device = self._device or make_device(self.options.device)
            backend = self.options.make_backend(device)
            if self.ep is not None:
                backend = self.ep.wrap(backend)
            from streamrt.trace import make_tracer

            self.tracer = make_tracer(bool(self.options.trace))
            if hasattr(backend, "counts"):  # --cpu-experts: the kernel's spans on their own track
                backend.tracer = self.tracer
            # --gpu-mem (else a card too small for the dense plane) -> the placement plan;
            # its streamed layers stream on this device's copy stream, its expert slots are the runtime's
            self.model, plan = load_placed(tree, device, gpu_mem=self.options.gpu_mem,
                                           backend=backend, tracer=self.tracer)
            self.options = self.options.with_plan(plan)
            if plan is not None and plan.streamed_layers:
                bar.say(format_plan(tree.config, plan))
                bar.say(f"streamrt: {self.model.layer_weights.line()}")
            self.model.prefill_chunk = self._prefill_chunk
            self.model.prefill_order = self.options.prefill_order
            bar.step("expert store")
            predictor = None
            if self.ep is not None:
                self.options = self.ep.shard_slots(self.options)
                predictor = self.ep.predictor(self.model)
            self.runtime = StreamingRuntime(tree, self.model, self.options, device=device, tracer=self.tracer,
                                            predictor=predictor)
            if self.ep is None or self.ep.rank == 0:
                bar.say(f"streamrt: {self.runtime.host_tier_line}")
                if hasattr(backend, "counts"):  # --cpu-experts: HostExpertBackend
                    bar.say(f"streamrt: {backend.line()}")
                if self.ep is not None:
                    bar.say(f"streamrt: {self.ep.line()}")
        self._loaded = True

    def _runner(self):
        """generate's forward driver: the first forward is the prefill, each later one a decode step."""
        calls = [0]

        def run(gen):
            gen = self.ep.shard(gen) if self.ep is not None else gen
            calls[0] += 1
            if calls[0] == 1:
                logits = self.runtime.run(gen, tokens=0)
                # The counters describe decoding: the prefill's compulsory misses would hide the
                # steady state the window and cache sizes are chosen for.
                self.runtime.reset_stats(keep_prefill=True)  # the prefill's own counters stay
                return logits
            return self.runtime.run(gen, tokens=1)

        return run

    def control_logits(self, ids):
        import torch

        self.load()
        cache = self.model.new_cache()
        x = torch.tensor(ids, dtype=torch.long)
        with torch.no_grad():
            gen = self.model.forward_steps(x, cache, last_only=True)
            return self.runtime.run(self.ep.shard(gen) if self.ep is not None else gen).reshape(-1).float()

    def generate(self, ids, sampling, on_token):
        steps = self.tokens(ids, sampling)
        while True:
            try:
                on_token(next(steps))
            except StopIteration as done:
                return done.value

    def tokens(self, ids: list[int], sampling: Sampling) -> Generator[int, None, GenStats]:
        """`generate` as an iterator: yields each token as it is drawn, returns the GenStats."""
        from streamrt.generate import generate_tokens

        self.load()
        steps = generate_tokens(
            self.model,
            ids,
            runner=self._runner(),
            max_new_tokens=sampling.max_new_tokens,
            temperature=0.0 if sampling.is_greedy else sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            min_p=sampling.min_p,
            repetition_penalty=sampling.repetition_penalty,
            seed=sampling.seed,
            stop_ids=[] if sampling.ignore_eos else sorted(self.tokenizer.stop_ids),
            hash_steps=True,
            max_context=self.context,
            prefix_cache=self.prefix,
        )
        r = yield from _tokens_of(steps)
        if (line := self.runtime.graphs_line) is not None and line != self._graphs_said:
            print(f"streamrt: {line}", file=sys.stderr)
            self._graphs_said = line
        st = self.runtime.stats
        hits = {}
        for tier in ("device", "host"):
            h, m = getattr(st, f"{tier}_hits"), getattr(st, f"{tier}_misses")
            if h + m:
                hits[tier] = h / (h + m)
        digest = hashlib.sha256(" ".join(r.prefill_hashes + [h for row in r.step_hashes for h in row]).encode())
        return GenStats(len(ids), r.new_tokens, r.prefill_s, r.decode_s, r.stop, hits, digest.hexdigest()[:16],
                        r.cached_tokens[0])

    def close(self) -> None:
        if self.runtime is not None:
            self.runtime.finish()


def _tokens_of(steps):
    """(row, token) pairs of one prompt -> its tokens; returns what `steps` returns."""
    while True:
        try:
            _, tok = next(steps)
        except StopIteration as done:
            return done.value
        yield tok


def _check_outputs_outside(tree, options) -> None:
    """--stats-json / --trace must not name a file of the tree: writing one (manifest.json, a
    dense or expert file) would destroy the checkpoint being run. New files in the tree are fine."""
    import os

    root = os.path.realpath(tree.root)
    for flag, path in (("--stats-json", options.stats_json), ("--trace", options.trace)):
        if not path:
            continue
        real = os.path.realpath(os.path.expanduser(path))
        rel = os.path.relpath(real, root).replace(os.sep, "/")
        if rel == "manifest.json" or rel in tree.manifest["files"]:
            raise StreamrtError(f"{flag} {path}: is {rel} of the model tree {tree.root}; give a file outside it")


class _LoadBar:
    """A tqdm bar on stderr over the loading stages; silent when not a terminal or in --json mode."""

    def __init__(self, *, enabled: bool, desc: str, total: int):
        self._bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(desc=desc, total=total, file=sys.stderr, leave=False,
                             bar_format="{desc}: {bar} {n}/{total} {postfix}")

    def step(self, what: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(what, refresh=False)
            self._bar.update(1)

    def say(self, line: str) -> None:
        """A line on stderr while the bar is up: the bar is cleared first and redrawn below it,
        so neither is cut (a bare print lands mid-bar and the bar's next redraw eats its start)."""
        if self._bar is not None:
            self._bar.clear()
            print(line, file=sys.stderr, flush=True)
            self._bar.refresh()
        else:
            print(line, file=sys.stderr)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.close()
