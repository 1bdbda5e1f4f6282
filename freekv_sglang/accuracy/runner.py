"""Run the tasks with every method on the same prompts; records go to a JSONL file as they finish.

Engine backend: each prompt is prefilled once (dense; prefill dominates CPU time) and its cache is
decoded by every (method, budget), several prompts batched per engine. SGLang backend: the same
token ids are posted to a running server's /generate with greedy sampling and scored the same way.

Records (one JSON object per line):
  {"kind": "sample", task, length, index, method, budget, depth, prompt_tokens, answers, output, score}
  {"kind": "stats", task, length, method, budget, decode_rows, correction_rate: [...], mean_cosine: [...],
   layers: [...], recall_bytes_now, recall_bytes_speculative, and for selecting methods diag_cases, hit_rate,
   mass_covered (diagnostics.py)}  (engine only; one per engine run)
A chunk of prompts is written once all its methods have run, so a rerun with the same output
directory skips the finished chunks (resume).
"""

from __future__ import annotations

import dataclasses
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

from ..calibration import CALIBRATION_TOKENS, calibration_ids
from ..config import FreeKVConfig
from .diagnostics import SelectionProbes
from .methods import Geometry, MethodSpec
from .tasks import Sample, make_samples


@dataclasses.dataclass
class RunConfig:
    tasks: list[str]
    lengths: list[int]
    budgets: list[int]
    samples: int
    methods: list[MethodSpec]
    geometry: Geometry
    seed: int = 0
    template: str = "chat"
    batch: int = 4
    backend: str = "engine"
    url: str = "http://127.0.0.1:30000"
    server_method: str = "sglang"  # row label of the server's answers
    server_budget: int | None = None
    calibration_tokens: int = CALIBRATION_TOKENS  # of the calibration text, for a selection that needs one


def cells(cfg: RunConfig) -> list[tuple[MethodSpec, int | None]]:
    """(method, budget) pairs decoded for every prompt; budget None for dense."""
    out: list[tuple[MethodSpec, int | None]] = []
    for m in cfg.methods:
        out.extend([(m, None)] if not m.uses_budget else [(m, b) for b in cfg.budgets])
    return out


class RecordLog:
    """Append-only JSONL of records; knows which (task, length, index, method, budget) are done."""

    def __init__(self, path: Path):
        self.path = path
        self.records: list[dict] = []
        if path.exists():
            with path.open() as f:
                self.records = [json.loads(line) for line in f if line.strip()]
        self.done = {_key(r) for r in self.records if r["kind"] == "sample"}

    def add(self, recs: list[dict]) -> None:
        # A sample already recorded (an earlier run with another batch size) keeps its first record.
        recs = [r for r in recs if r["kind"] != "sample" or _key(r) not in self.done]
        with self.path.open("a") as f:
            for r in recs:
                f.write(json.dumps(r) + "\n")
        self.records.extend(recs)
        self.done.update(_key(r) for r in recs if r["kind"] == "sample")


def _key(r: dict) -> tuple:
    return r["task"], r["length"], r["index"], r["method"], r["budget"]


def _sample_record(s: Sample, method: str, budget: int | None, output: str) -> dict:
    return dict(kind="sample", task=s.task, length=s.length, index=s.index, method=method, budget=budget,
                depth=s.depth, prompt_tokens=len(s.ids), answers=list(s.answers), output=output,
                score=s.score(output))


# ---- engine backend ----------------------------------------------------------------------------

class EngineBackend:
    def __init__(self, model, tokenizer, cfg: RunConfig, log=print):
        from ..hf_adapter import FreeKVModel, model_shape

        self.model, self.tok, self.cfg, self.log = model, tokenizer, cfg, log
        self.shape = model_shape(model)
        self._build = FreeKVModel.build

    def run_chunk(self, chunk: list[Sample], todo: list[tuple[MethodSpec, int | None]]) -> list[dict]:
        cfg = self.cfg
        out: list[dict] = []
        max_new = max(s.max_new_tokens for s in chunk)
        max_context = max(len(s.ids) for s in chunk) + max_new + 1
        caches: dict[str, tuple[list, float]] = {}  # by FreeKVModel.prefill_mode: prompts' caches, prefill s
        # One host arena for the chunk's every engine: pinning (on a GPU host) one per method and budget cost more
        # than some of their decodes. Each engine's requests leave it when they finish, so it is whole again.
        pool = self._host_pool(len(chunk), max_context)
        for spec, budget in todo:
            fkv_cfg = spec.config(budget or 0, cfg.geometry, self.shape.num_layers)
            fm = self._build(self.model, fkv_cfg, max_requests=len(chunk), max_context=max_context,
                             method=spec.engine_method, host_pool=pool)
            if fm.needs_calibration:
                fm.calibrate(calibration_ids(self.tok, cfg.calibration_tokens))
            if fm.prefill_mode not in caches:
                t0 = time.perf_counter()
                made = [fm.prefill(list(s.ids)) for s in chunk]
                caches[fm.prefill_mode] = made, time.perf_counter() - t0
                self.log(f"  {fm.prefill_mode} prefill {len(chunk)} x ~{len(chunk[0].ids)} tokens: "
                         f"{caches[fm.prefill_mode][1]:.1f} s")
            prompts, prefill = caches[fm.prefill_mode]
            probe = None
            if spec.engine_method != "streaming" and spec.uses_budget:
                probe = SelectionProbes(fm.engines)
            t0 = time.perf_counter()
            # Samples of one task share max_new_tokens; eos ends a sample early.
            outs = fm.generate(prompts, max_new, eos_token_id=self.tok.eos_token_id, max_batch=len(chunk))
            dt = time.perf_counter() - t0
            texts = [self.tok.decode(o, skip_special_tokens=True) for o in outs]
            recs = [_sample_record(s, spec.name, budget, t) for s, t in zip(chunk, texts)]
            recs.append(self._stats_record(chunk[0], spec, budget, fm, outs, dt, prefill))
            diag = ""
            if probe is not None:
                recs[-1].update(probe.record())
                diag = f" hit={recs[-1]['hit_rate']:.3f} mass={recs[-1]['mass_covered']:.3f}"
            out.extend(recs)
            mean = sum(r["score"] for r in recs[:-1]) / len(chunk)
            self.log(f"  {spec.name:<18} budget={budget!s:<5} score={mean:.2f}{diag} decode {dt:.1f} s")
            del fm
            if pool.free_pages != pool.arena.shape[0]:
                raise RuntimeError(f"{spec.name} left {pool.arena.shape[0] - pool.free_pages} host pages allocated")
        return out

    def _host_pool(self, requests: int, max_context: int):
        from ..host_pool import LocalHostPool

        s, geo = self.shape, self.cfg.geometry
        p, dtype = geo.page_size, next(self.model.parameters()).dtype
        host_dtype = FreeKVConfig(host_dtype=geo.host_dtype).host_torch_dtype(dtype)
        return LocalHostPool(requests * -(-max_context // p), s.num_layers, s.num_kv_heads, p, s.head_dim, host_dtype)

    def _stats_record(self, s: Sample, spec: MethodSpec, budget, fm, outs, decode_s, prefill_s) -> dict:
        st = fm.stats()
        layers = sorted(st["correction_rate"])
        # stats() rates are per (decode row, KV head); a sample decodes len(out) - 1 rows (the first
        # token comes from prefill), which weights this engine run when runs are merged.
        return dict(kind="stats", task=s.task, length=s.length, method=spec.name, budget=budget,
                    decode_rows=sum(len(o) - 1 for o in outs), layers=layers,
                    correction_rate=[st["correction_rate"][i] for i in layers],
                    early_correction_rate=[st["early_correction_rate"][i] for i in layers],
                    mean_cosine=[st["mean_cosine"][i] for i in layers],
                    recall_bytes_now=st["recall_bytes_now"], recall_bytes_speculative=st["recall_bytes_speculative"],
                    decode_s=decode_s, prefill_s=prefill_s, samples=len(outs))


# ---- SGLang backend ----------------------------------------------------------------------------

class SGLangBackend:
    """Greedy /generate on a running SGLang server (urllib only). The prompt goes as token ids so the
    server sees exactly the engine's prompt."""

    def __init__(self, tokenizer, cfg: RunConfig, log=print, timeout: float = 600.0):
        self.tok, self.cfg, self.log, self.timeout = tokenizer, cfg, log, timeout
        self.url = cfg.url.rstrip("/") + "/generate"

    def generate(self, chunk: list[Sample]) -> list[str]:
        body = {"input_ids": [list(s.ids) for s in chunk],
                "sampling_params": [{"temperature": 0.0, "max_new_tokens": s.max_new_tokens,
                                     "skip_special_tokens": True} for s in chunk]}
        req = urllib.request.Request(self.url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                out = json.loads(resp.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"SGLang server at {self.url} answered {e.code}: {e.read()[:500]!r}") from e
        except urllib.error.URLError as e:
            raise RuntimeError(f"cannot reach an SGLang server at {self.url}: {e.reason}") from e
        if isinstance(out, dict):
            out = [out]
        if len(out) != len(chunk) or not all("text" in o for o in out):
            raise RuntimeError(f"unexpected /generate response from {self.url}: {str(out)[:500]}")
        for s, o in zip(chunk, out):
            self._check_not_clipped(s, o.get("meta_info", {}))
        return [o["text"] for o in out]

    def _check_not_clipped(self, s: Sample, meta: dict) -> None:
        """SGLang cuts max_new_tokens to fit its context length less two tokens; an answer cut short there would
        score as a wrong answer while the engine, which has no such margin, answers in full."""
        reason, n = meta.get("finish_reason"), meta.get("completion_tokens")
        if isinstance(reason, dict) and reason.get("type") == "length" and n is not None and n < s.max_new_tokens:
            need = len(s.ids) + s.max_new_tokens + 2
            raise RuntimeError(
                f"the server at {self.url} stopped {s.task}/{s.length}/#{s.index} after {n} of {s.max_new_tokens} "
                f"new tokens: its context length leaves no room for the answer ({len(s.ids)} prompt tokens). "
                f"Start it with --context-length {need} or more (above the model's own, with "
                f"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1), or run shorter --lengths")

    def run_chunk(self, chunk: list[Sample], todo) -> list[dict]:
        t0 = time.perf_counter()
        texts = self.generate(chunk)
        name, budget = self.cfg.server_method, self.cfg.server_budget
        recs = [_sample_record(s, name, budget, t) for s, t in zip(chunk, texts)]
        mean = sum(r["score"] for r in recs) / len(recs)
        self.log(f"  {name} budget={budget} score={mean:.2f} ({time.perf_counter() - t0:.1f} s)")
        return recs


# ---- driver ------------------------------------------------------------------------------------

def run(cfg: RunConfig, tokenizer, out_dir: Path, model=None, log=print) -> RecordLog:
    """Generate the samples, run every pending (sample, method, budget), return all records."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rec = RecordLog(out_dir / "records.jsonl")
    if cfg.backend == "engine":
        if model is None:
            raise ValueError("the engine backend needs a model")
        backend = EngineBackend(model, tokenizer, cfg, log)
        todo_all = [(m.name, b) for m, b in cells(cfg)]
    elif cfg.backend == "sglang":
        backend = SGLangBackend(tokenizer, cfg, log)
        todo_all = [(cfg.server_method, cfg.server_budget)]
    else:
        raise ValueError(f"backend must be 'engine' or 'sglang', got {cfg.backend!r}")
    for task in cfg.tasks:
        for length in cfg.lengths:
            samples = make_samples(tokenizer, task, length, cfg.samples, cfg.seed, cfg.template)
            pending = [s for s in samples
                       if any((task, length, s.index, m, b) not in rec.done for m, b in todo_all)]
            log(f"{task} @ {length}: {len(pending)}/{len(samples)} samples to run "
                f"({len(samples[0].ids)} prompt tokens)")
            for i in range(0, len(pending), cfg.batch):
                chunk = pending[i:i + cfg.batch]
                todo = ([c for c in cells(cfg) if any((task, length, s.index, c[0].name, c[1]) not in rec.done
                                                      for s in chunk)] if cfg.backend == "engine" else None)
                with torch.inference_mode():
                    rec.add(backend.run_chunk(chunk, todo))
    return rec
