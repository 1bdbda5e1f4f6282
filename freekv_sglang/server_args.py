"""FreeKV's server flags for SGLang: definitions, parsing, and the checks that refuse what FreeKV cannot serve.

Nothing here imports SGLang: the flags are added to any argparse parser, and the checks read a ServerArgs-like
object by attribute name. freekv_patches wires them into SGLang (see patches/server_args.py).

Two ways to turn FreeKV on:
- the CLI: ``python -m sglang.launch_server ... --kv-retrieval freekv --kv-budget 2048 ...``;
- the environment, for ``sglang.Engine(...)`` / ``sgl.Runtime(...)``, whose keyword arguments cannot carry
  unknown flags: ``SGLANG_KV_RETRIEVAL=freekv`` and ``FREEKV_ARGS="--kv-budget 2048 --kv-window 512"``, the
  latter parsed by the same parser. On the CLI route, flags given on the command line override the environment.

A server that runs FreeKV carries ``server_args._freekv``, a FreeKVServerSettings (an underscore attribute, so it
survives the pickling of ServerArgs into SGLang's scheduler processes); without FreeKV the attribute is None or
absent and nothing else changes.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from .config import (ATTENTIONS, BENCH_SELECTIONS, CORRECT_AT, DEFAULT_HYSTERESIS, DEFAULT_SKETCH_CHANNELS,
                     EARLY_WEIGHTS, HOST_DTYPES, PREFILLS, RECALL_MODES, SERVABLE_SELECTIONS, SPECULATE_AT,
                     FreeKVConfig)

ENV_KV_RETRIEVAL = "SGLANG_KV_RETRIEVAL"
ENV_FREEKV_ARGS = "FREEKV_ARGS"
# The kvstore endpoint the launcher hands to the scheduler processes (same name as freekv_kvstore's default).
ENV_KVSTORE_ENDPOINT = "FREEKV_KVSTORE_ENDPOINT"

KV_RETRIEVAL_CHOICES = ("none", "freekv", "louiskv")
# FreeKVAttnBackend wraps these; SGLang's own choice (fa3 on Hopper, for many models) is not one of them.
SUPPORTED_ATTENTION_BACKENDS = ("triton", "flashinfer")
# Set when the user names no attention backend at all, before SGLang resolves its own default.
DEFAULT_ATTENTION_BACKEND = "triton"
DEFAULT_KVSTORE_ARENA_GB = 16.0
DEFAULT_KVSTORE_TIMEOUT_S = 5.0
# An embedded daemon is restarted within 2 s of a crash; a shorter deadline would end requests a restart could save.
MIN_KVSTORE_TIMEOUT_S = 2.5

_GiB = 1 << 30
_DEFAULTS = FreeKVConfig()

# dest name -> (flag, FreeKVConfig field or None)
_KNOB_FLAGS = {
    "kv_budget": ("--kv-budget", "budget"),
    "kv_sink": ("--kv-sink", "sink"),
    "kv_window": ("--kv-window", "window"),
    "kv_victim": ("--kv-victim", "victim"),
    "kv_page_size": ("--kv-page-size", "page_size"),
    "kv_host_dtype": ("--kv-host-dtype", "host_dtype"),
    "kv_correction_threshold": ("--kv-correction-threshold", "tau"),
    "kv_dense_layers": ("--kv-dense-layers", "dense_layers"),
    "kv_recall": ("--kv-recall", "recall"),
    "kv_recall_programs": ("--kv-recall-programs", "recall_programs"),
    "kv_recall_block": ("--kv-recall-block", "recall_block"),
    "kv_score_programs": ("--kv-score-programs", "score_programs"),
    "kv_speculate_at": ("--kv-speculate-at", "speculate_at"),
    "kv_correct_at": ("--kv-correct-at", "correct_at"),
    "kv_early_weights": ("--kv-early-weights", "early_weights"),
    "kv_attention": ("--kv-attention", "attention"),
    "kv_selection": ("--kv-selection", "selection"),
    "kv_rerank_factor": ("--kv-rerank-factor", "rerank_factor"),
    "kv_sketch_channels": ("--kv-sketch-channels", "sketch_channels"),
    "kv_hysteresis": ("--kv-hysteresis", "hysteresis"),
    "kv_boundary_threshold": ("--kv-boundary-threshold", "boundary_tau"),
    "kv_cluster_size": ("--kv-cluster-size", "cluster_size"),
    "kv_segment": ("--kv-segment", "segment"),
    "kv_kmeans_iters": ("--kv-kmeans-iters", "kmeans_iters"),
    "kv_prefill": ("--kv-prefill", "prefill"),
    "kv_tsp_layer": ("--kv-tsp-layer", "tsp_layer"),
    "kv_tsp_keep": ("--kv-tsp-keep", "tsp_keep"),
    "kv_bench_correction_rate": ("--kv-bench-correction-rate", "replay_correction_rate"),
    "kv_bench_churn": ("--kv-bench-churn", "replay_churn"),
    "kv_bench_returns": ("--kv-bench-returns", "replay_returns"),
    "kv_bench_late_correction_rate": ("--kv-bench-late-correction-rate", "replay_late_rate"),
}
# Knobs of one retrieval policy only: given with the other, they are refused rather than ignored.
_FREEKV_ONLY = ("kv_correction_threshold", "kv_recall_programs", "kv_score_programs", "kv_speculate_at",
                "kv_correct_at", "kv_early_weights", "kv_selection",
                "kv_rerank_factor", "kv_sketch_channels", "kv_hysteresis", "kv_bench_correction_rate",
                "kv_bench_churn", "kv_bench_returns", "kv_bench_late_correction_rate")
_LOUISKV_ONLY = ("kv_boundary_threshold", "kv_cluster_size", "kv_segment", "kv_kmeans_iters")
FLAG_DESTS = ("kv_retrieval", *_KNOB_FLAGS, "kvstore_endpoint", "kvstore_arena_gb", "kvstore_timeout")
FLAGS = ("--kv-retrieval", *(flag for flag, _ in _KNOB_FLAGS.values()), "--kvstore-endpoint", "--kvstore-arena-gb",
         "--kvstore-timeout")


class FreeKVArgsError(ValueError):
    """A server argument (or model) FreeKV cannot serve with; the message names the flag to change."""


@dataclasses.dataclass(frozen=True)
class FreeKVServerSettings:
    """What a FreeKV-enabled SGLang server carries in ``server_args._freekv`` (picklable).

    config: the FreeKV knobs.
    kvstore_endpoint: the kvstore daemon to connect to. None until the launcher starts an embedded daemon (when no
        --kvstore-endpoint was given), after which it holds that daemon's endpoint.
    kvstore_arena_gb: arena budget in GiB of the embedded daemon (unused with an external one).
    kvstore_timeout_s: how long a kvstore call may wait for the daemon before the requests that need it end.
    """

    config: FreeKVConfig
    kvstore_endpoint: str | None = None
    kvstore_arena_gb: float = DEFAULT_KVSTORE_ARENA_GB
    kvstore_timeout_s: float = DEFAULT_KVSTORE_TIMEOUT_S

    def __post_init__(self) -> None:
        if not isinstance(self.config, FreeKVConfig):
            raise TypeError(f"config must be a FreeKVConfig, got {type(self.config).__name__}")
        gb = self.kvstore_arena_gb
        if isinstance(gb, bool) or not isinstance(gb, (int, float)) or not gb > 0:
            raise FreeKVArgsError(f"--kvstore-arena-gb must be a positive number of GiB, got {gb!r}")
        t = self.kvstore_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not MIN_KVSTORE_TIMEOUT_S <= t <= 600:
            raise FreeKVArgsError(f"--kvstore-timeout must be {MIN_KVSTORE_TIMEOUT_S:g} to 600 seconds, got {t!r}")
        if self.kvstore_endpoint is not None and not self.kvstore_endpoint.startswith(("ipc://", "tcp://")):
            raise FreeKVArgsError(
                f"--kvstore-endpoint must be ipc://<path> or tcp://<host>:<port>, got {self.kvstore_endpoint!r}"
            )

    @property
    def embedded_kvstore(self) -> bool:
        """True until an endpoint is known: the launcher must start a daemon of its own."""
        return self.kvstore_endpoint is None

    def with_endpoint(self, endpoint: str) -> FreeKVServerSettings:
        return dataclasses.replace(self, kvstore_endpoint=endpoint)


# ----------------------------------------------------------------------------------------------- flags


def add_freekv_args(parser: argparse.ArgumentParser, retrieval_action: type[argparse.Action] | None = None) -> None:
    """Add the FreeKV flags to parser. Every default is None ("not given"); FreeKVConfig supplies the values.
    retrieval_action: an argparse.Action class for --kv-retrieval (freekv_patches checks its hooks there)."""
    g = parser.add_argument_group(
        "FreeKV KV retrieval",
        "Keep each request's full KV cache in host memory (a kvstore daemon) and only a fixed budget of pages "
        "per request and KV head on the GPU. With the radix cache on, cached prefixes are shared as kvstore host "
        "pages (docs/radix.md); see freekv_sglang/server_args.py for what is refused. Also settable for "
        f"sglang.Engine / sgl.Runtime through ${ENV_KV_RETRIEVAL}=freekv "
        f'and ${ENV_FREEKV_ARGS}="--kv-budget ...".',
    )
    g.add_argument(
        "--kv-retrieval",
        action=retrieval_action or "store",
        choices=KV_RETRIEVAL_CHOICES,
        default=None,
        help="KV retrieval method for decode attention: 'freekv' turns FreeKV on; 'louiskv' is LouisKV's policy "
        "(retrieval at semantic boundaries, prompt clusters, output segments), served with --disable-radix-cache "
        f"(default: none, or ${ENV_KV_RETRIEVAL}).",
    )
    g.add_argument("--kv-budget", type=int, default=None, metavar="TOKENS",
                   help="tokens of selected pages per KV head and request, besides sink and window, "
                        f"a multiple of --kv-page-size (default {_DEFAULTS.budget})")
    g.add_argument("--kv-sink", type=int, default=None, metavar="TOKENS",
                   help=f"first tokens of every request, always attended (default {_DEFAULTS.sink})")
    g.add_argument("--kv-window", type=int, default=None, metavar="TOKENS",
                   help=f"most recent tokens, always attended, at least one page (default {_DEFAULTS.window})")
    g.add_argument("--kv-victim", type=int, default=None, metavar="TOKENS",
                   help="tokens per KV head and request of recently evicted pages kept on the GPU, a multiple of "
                        "--kv-page-size: a selection returning to one copies it on the GPU instead of recalling it "
                        "from host memory; costs GPU memory like --kv-budget, so fewer requests fit "
                        f"(default {_DEFAULTS.victim}: none)")
    g.add_argument("--kv-page-size", type=int, default=None, metavar="TOKENS",
                   help="tokens per page, a power of two; the unit of selection, offload and recall. SGLang's "
                        f"--page-size is set to it (default {_DEFAULTS.page_size})")
    g.add_argument("--kv-host-dtype", choices=HOST_DTYPES, default=None,
                   help="how host pages hold K and V: 'auto' in the KV cache's dtype; 'fp8_e4m3' as e4m3 values with "
                        "a power-of-two scale per token, KV head and K/V (129 bytes per 128 values): the arena holds "
                        "twice the tokens and recalls read half the bytes, at e4m3's rounding of recalled pages "
                        f"(default {_DEFAULTS.host_dtype})")
    g.add_argument("--kv-correction-threshold", type=float, default=None, metavar="TAU",
                   help="cosine similarity of adjacent queries below which a KV head is reselected before "
                        f"attention; 0 = pure speculation, 1 = reselect every step (default {_DEFAULTS.tau})")
    g.add_argument("--kv-dense-layers", type=int, default=None, metavar="N",
                   help=f"the first N layers attend densely over the whole context (default {_DEFAULTS.dense_layers})")
    g.add_argument("--kv-recall", choices=RECALL_MODES, default=None,
                   help="'delta' recalls only pages a reselection adds; 'all' recalls every selected page of a "
                        f"reselected head, an ablation (default {_DEFAULTS.recall})")
    g.add_argument("--kv-recall-programs", type=int, default=None, metavar="N",
                   help="GPU programs of the speculative recall, which runs beside the model's GEMMs; 0 = one per "
                        f"page recalled (default {_DEFAULTS.recall_programs})")
    g.add_argument("--kv-recall-block", type=int, default=None, metavar="B",
                   help="slots per GPU program of the recall before attention (0 or a power of two); 0 = one "
                        f"program per (request, KV head, slot) (default {_DEFAULTS.recall_block})")
    g.add_argument("--kv-score-programs", type=int, default=None, metavar="N",
                   help="GPU programs of the 'channels' selection's speculative scoring, which runs beside the "
                        "model's GEMMs; 0 = one per (request, KV head, chunk of pages) "
                        f"(default {_DEFAULTS.score_programs})")
    g.add_argument("--kv-speculate-at", choices=SPECULATE_AT, default=None,
                   help="where a layer's speculative selection starts: 'attention' right after the layer's attention; "
                        "'next_recall' beside the next sparse layer's recall before attention, so its scoring does not "
                        f"hold the SMs ahead of the output projection (default {_DEFAULTS.speculate_at})")
    g.add_argument("--kv-correct-at", choices=CORRECT_AT, default=None,
                   help="where the correction starts: 'layer' after the layer's QKV projection (the paper's); "
                        "'previous_mlp' also one layer early, from a query predicted off the previous layer's mid "
                        "residual while its MLP runs, so the check after the projection corrects only the heads the "
                        "prediction missed (slower than 'layer' on an H200, session 51); 'previous_mlp_only' one layer "
                        "early alone, with nothing of the correction on the critical path (a head the prediction "
                        f"misses keeps last step's selection for the step) (default {_DEFAULTS.correct_at})")
    g.add_argument("--kv-early-weights", choices=EARLY_WEIGHTS, default=None,
                   help="with --kv-correct-at previous_mlp(_only): the W_q the predicted query is projected with, "
                        "'model' the model's own, 'fp8' an e4m3 copy made at startup (half the bytes of the "
                        "projection's W_q each layer, ~0.5 GB of GPU memory on Llama-3.1-8B, counted in the memory "
                        "plan; needs a GPU with FP8, sm_89 or newer; re-derived after a weight update) "
                        f"(default {_DEFAULTS.early_weights})")
    g.add_argument("--kv-attention", choices=ATTENTIONS, default=None,
                   help="sparse layers' attention: 'fused' through FreeKV's own kernel in one launch after the "
                        "correction's recall (the fastest; rounds apart from full KV), 'backend' through the "
                        "attention backend's decode kernel (exact as full KV when the budget covers the context; the "
                        "only one with --enable-deterministic-inference), 'split' through FreeKV's own kernels, which "
                        f"attend to the pages that stay beside that recall (default {_DEFAULTS.attention})")
    g.add_argument("--kv-selection", choices=(*SERVABLE_SELECTIONS, *BENCH_SELECTIONS), default=None,
                   help="how pages are scored: 'sketch' scores every page as attention mass from its mid-range "
                        "keys and the 2-bit codes of the channels the query weighs most (head_dim / 4 GPU bytes "
                        "per token, KV head and layer); 'rerank' rescores that sketch's best candidates from all "
                        "their codes; 'channels' scores from 4-bit codes of the key channels a calibration pass "
                        "at start-up picked for the model (--kv-sketch-channels of them, default 32: 16 GPU bytes "
                        "per token, KV head and layer); 'means' the paper's group-mean softmax "
                        "of min / max bounds; 'quest' the max over the group of those bounds; 'replay' scores "
                        "nothing, a benchmark baseline for --kv-bench-churn "
                        f"(default {_DEFAULTS.selection})")
    g.add_argument("--kv-rerank-factor", type=int, default=None, metavar="N",
                   help="N > 0: the rerank rescores the best N x (budget pages) of a sketch over every page (a few "
                        "channels' codes and the page's mid-range) from all their codes; 0: every page (costlier) "
                        f"(default {_DEFAULTS.rerank_factor})")
    g.add_argument("--kv-sketch-channels", type=int, default=None, metavar="N",
                   help="key channels the sketch (rerank and sketch) reads per KV head, the query's largest; a multiple of 4 "
                        f"up to the head dim (default min({DEFAULT_SKETCH_CHANNELS}, head dim)). With channels: the "
                        "calibrated channels, a multiple of 32 (default 32)")
    g.add_argument("--kv-hysteresis", type=float, default=None, metavar="H",
                   help="a reselection keeps a resident page unless another holds more than (1 + H) times its "
                        "attention mass: fewer pages trade places at the top-k's edge, so fewer recalls; 0 = the "
                        f"plain top-k (default {DEFAULT_HYSTERESIS:g} for sketch, rerank and means; none for quest)")
    g.add_argument("--kv-boundary-threshold", type=float, default=None, metavar="TAU",
                   help="LouisKV: mean cosine similarity of adjacent queries over all query heads below which a "
                        f"request's layer retrieves (default {_DEFAULTS.boundary_tau}, the paper's)")
    g.add_argument("--kv-cluster-size", type=int, default=None, metavar="TOKENS",
                   help="LouisKV: mean tokens per k-means cluster of the prompt's keys, a divisor of --kv-page-size "
                        f"(default {_DEFAULTS.cluster_size}, the paper's)")
    g.add_argument("--kv-segment", type=int, default=None, metavar="TOKENS",
                   help="LouisKV: longest temporal segment of generated tokens, a multiple of --kv-page-size "
                        f"(default {_DEFAULTS.segment})")
    g.add_argument("--kv-kmeans-iters", type=int, default=None, metavar="N",
                   help=f"LouisKV: Lloyd iterations of the prompt clustering (default {_DEFAULTS.kmeans_iters})")
    g.add_argument("--kv-prefill", choices=PREFILLS, default=None,
                   help="'tsp': FastKV's token-selective propagation (only --kv-tsp-keep tokens of a prompt go past "
                   "layer --kv-tsp-layer), with --kv-retrieval freekv or alone (over SGLang's KV pool, --page-size "
                   "1); needs --chunked-prefill-size -1, --disable-radix-cache and --disable-prefill-cuda-graph "
                   "(default: full)")
    g.add_argument("--kv-tsp-layer", type=int, default=None, metavar="LAYER",
                   help=f"--kv-prefill tsp: the layer whose attention picks the propagated tokens "
                   f"(default: {_DEFAULTS.tsp_layer})")
    g.add_argument("--kv-tsp-keep", type=int, default=None, metavar="TOKENS",
                   help=f"--kv-prefill tsp: tokens propagated past --kv-tsp-layer (default: {_DEFAULTS.tsp_keep})")
    g.add_argument("--kv-bench-correction-rate", type=float, default=None, metavar="RATE",
                   help="benchmarks only: flag each (request, KV head) for correction with this probability per "
                        "step instead of by query similarity, to decode a random-weight model at a real model's "
                        "correction rate (FreeKV's paper: 0.04-0.14 at tau 0.8 on Llama-3.1-8B); selection and "
                        "recall are unchanged (default: off)")
    g.add_argument("--kv-bench-churn", type=float, default=None, metavar="SHARE",
                   help="benchmarks only: each head's selection replaces this share of its budget's pages, at "
                        "random, instead of the pages its scores rank (scoring still runs), to decode a random-weight "
                        "model at a real model's churn (SmolLM2-135M: 0.15 a step); default: off")
    g.add_argument("--kv-bench-returns", type=float, default=None, metavar="SHARE",
                   help="benchmarks only, with --kv-bench-churn and --kv-victim: this share of the churned pages "
                        "returns to pages the head evicted lately (SmolLM2-135M: 0.58 with one budget of "
                        "--kv-victim); default: off")
    g.add_argument("--kv-bench-late-correction-rate", type=float, default=None, metavar="RATE",
                   help="benchmarks only, with --kv-correct-at previous_mlp and --kv-bench-correction-rate (then the "
                        "early corrections' rate): the check after the QKV projection flags each (request, KV head) "
                        "with this probability instead of by query similarity (SmolLM2-135M: ~0.05); default: off")
    g.add_argument("--kvstore-endpoint", default=None, metavar="URL",
                   help="an already running kvstore daemon (ipc://<path> or tcp://<host>:<port>; a tcp daemon's "
                        "token comes from $FREEKV_KVSTORE_TOKEN). Default: start an embedded daemon with this "
                        "server and stop it with the server.")
    g.add_argument("--kvstore-arena-gb", type=float, default=None, metavar="GIB",
                   help="host-memory budget of the embedded kvstore daemon in GiB; must fit in the host's memory "
                        f"and /dev/shm (default {DEFAULT_KVSTORE_ARENA_GB:g})")
    g.add_argument("--kvstore-timeout", type=float, default=None, metavar="SECONDS",
                   help="how long a kvstore call waits for the daemon (resending meanwhile) before the requests "
                        "that need it end with an abort; at least the 2 s an embedded daemon takes to restart "
                        f"(default {DEFAULT_KVSTORE_TIMEOUT_S:g})")


class _RaisingParser(argparse.ArgumentParser):
    """argparse that raises instead of exiting (for $FREEKV_ARGS)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise FreeKVArgsError(f"${ENV_FREEKV_ARGS}: {message}")


def freekv_parser() -> argparse.ArgumentParser:
    """A parser that knows only the FreeKV flags (the same definitions the SGLang CLI gets)."""
    parser = _RaisingParser(prog=f"${ENV_FREEKV_ARGS}", add_help=False)
    add_freekv_args(parser)
    return parser


def flag_values(namespace: Any) -> dict[str, Any]:
    """The FreeKV flag values of an argparse namespace (missing attributes count as not given)."""
    return {dest: getattr(namespace, dest, None) for dest in FLAG_DESTS}


def env_flag_values(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Flag values from $SGLANG_KV_RETRIEVAL and $FREEKV_ARGS (parsed by freekv_parser)."""
    environ = os.environ if environ is None else environ
    values = dict.fromkeys(FLAG_DESTS)
    raw = environ.get(ENV_FREEKV_ARGS, "").strip()
    if raw:
        try:
            argv = shlex.split(raw)
        except ValueError as e:
            raise FreeKVArgsError(f"${ENV_FREEKV_ARGS} is not a valid shell-quoted argument list: {e}") from None
        values = flag_values(freekv_parser().parse_args(argv))
    mode = environ.get(ENV_KV_RETRIEVAL, "").strip()
    if mode:
        if mode not in KV_RETRIEVAL_CHOICES:
            raise FreeKVArgsError(f"${ENV_KV_RETRIEVAL} must be one of {', '.join(KV_RETRIEVAL_CHOICES)}, got {mode!r}")
        if values["kv_retrieval"] is not None and values["kv_retrieval"] != mode:
            raise FreeKVArgsError(
                f"${ENV_KV_RETRIEVAL}={mode} contradicts --kv-retrieval {values['kv_retrieval']} in ${ENV_FREEKV_ARGS}"
            )
        values["kv_retrieval"] = mode
    return values


def merge_flag_values(primary: Mapping[str, Any], fallback: Mapping[str, Any]) -> dict[str, Any]:
    """Each flag from primary where given there, else from fallback (the CLI over the environment)."""
    return {dest: primary.get(dest) if primary.get(dest) is not None else fallback.get(dest) for dest in FLAG_DESTS}


def settings_from_values(values: Mapping[str, Any]) -> FreeKVServerSettings | None:
    """FreeKVServerSettings for the given flag values, or None when FreeKV is off (FreeKVConfig's ValueErrors pass
    through, reworded to name the flag)."""
    tsp_knobs = [_KNOB_FLAGS[d][0] for d in ("kv_tsp_layer", "kv_tsp_keep") if values.get(d) is not None]
    if tsp_knobs and values.get("kv_prefill") != "tsp":
        raise FreeKVArgsError(f"{', '.join(tsp_knobs)} apply only to --kv-prefill tsp: drop them")
    mode = values.get("kv_retrieval") or "none"
    if mode not in KV_RETRIEVAL_CHOICES:
        raise FreeKVArgsError(f"--kv-retrieval must be one of {', '.join(KV_RETRIEVAL_CHOICES)}, got {mode!r}")
    if values.get("kv_prefill") == "tsp" and mode == "louiskv":
        raise FreeKVArgsError("--kv-prefill tsp is not served with --kv-retrieval louiskv (its prompt clustering "
                              "would see only the propagated tokens): pass --kv-retrieval freekv or none")
    if mode == "none":
        return None  # FreeKV off; --kv-prefill tsp alone is tsp_alone_from_values
    knobs = {field: values[dest] for dest, (_, field) in _KNOB_FLAGS.items() if values.get(dest) is not None}
    foreign = _LOUISKV_ONLY if mode == "freekv" else _FREEKV_ONLY
    given = [_KNOB_FLAGS[dest][0] for dest in foreign if values.get(dest) is not None]
    if given:
        raise FreeKVArgsError(f"{', '.join(given)} {'does' if len(given) == 1 else 'do'} not apply to "
                              f"--kv-retrieval {mode}: drop {'it' if len(given) == 1 else 'them'}")
    knobs["retrieval"] = mode
    try:
        config = FreeKVConfig(**knobs)
    except ValueError as e:
        raise FreeKVArgsError(f"{_name_flags(str(e))}") from e
    if config.prefill == "tsp" and config.dense_layers > config.tsp_layer:
        raise FreeKVArgsError(f"--kv-dense-layers {config.dense_layers} must not exceed --kv-tsp-layer "
                              f"{config.tsp_layer}: the server keeps dense layers in SGLang's KV pool, which holds "
                              "every prompt token, and the layers after the TSP layer hold only the propagated ones")
    arena, timeout = values.get("kvstore_arena_gb"), values.get("kvstore_timeout")
    return FreeKVServerSettings(
        config=config,
        kvstore_endpoint=values.get("kvstore_endpoint") or None,
        kvstore_arena_gb=DEFAULT_KVSTORE_ARENA_GB if arena is None else arena,
        kvstore_timeout_s=DEFAULT_KVSTORE_TIMEOUT_S if timeout is None else timeout,
    )


def tsp_alone_from_values(values: Mapping[str, Any]) -> FreeKVConfig | None:
    """--kv-prefill tsp without FreeKV retrieval (FastKV's propagation over SGLang's own KV pool): the config holding
    its tsp_layer and tsp_keep, or None when not asked for."""
    if values.get("kv_prefill") != "tsp" or (values.get("kv_retrieval") or "none") != "none":
        return None
    others = [flag for dest, (flag, _) in _KNOB_FLAGS.items()
              if dest not in ("kv_prefill", "kv_tsp_layer", "kv_tsp_keep") and values.get(dest) is not None]
    others += [flag for dest, flag in (("kvstore_endpoint", "--kvstore-endpoint"),
                                       ("kvstore_arena_gb", "--kvstore-arena-gb"),
                                       ("kvstore_timeout", "--kvstore-timeout")) if values.get(dest) is not None]
    if others:
        raise FreeKVArgsError(f"{', '.join(others)} apply only to --kv-retrieval freekv; --kv-prefill tsp alone takes "
                              "--kv-tsp-layer and --kv-tsp-keep")
    knobs = {field: values[dest] for dest, (_, field) in _KNOB_FLAGS.items()
             if dest in ("kv_tsp_layer", "kv_tsp_keep") and values.get(dest) is not None}
    try:
        return FreeKVConfig(prefill="tsp", dense_layers=0, **knobs)
    except ValueError as e:
        raise FreeKVArgsError(f"{_name_flags(str(e))}") from e


def tsp_alone_problems(server_args: Any, config: FreeKVConfig) -> list[str]:
    """Every reason --kv-prefill tsp alone cannot run with these (SGLang) server arguments."""
    g = lambda name, default=None: getattr(server_args, name, default)  # noqa: E731
    problems = _tsp_problems(g)
    if g("page_size") not in (None, 1):
        problems.append(f"use --page-size 1 with --kv-prefill tsp alone (got {g('page_size')}): the later layers' "
                        "compacted tokens are listed one token slot each")
    if g("speculative_algorithm") not in (None, "", "NONE", "none"):
        problems.append(f"drop --speculative-algorithm {g('speculative_algorithm')} with --kv-prefill tsp")
    for flag in ("enable_mixed_chunk", "enable_dp_attention", "enable_hierarchical_cache", "enable_two_batch_overlap",
                 "enable_pdmux", "enable_hisparse"):
        if g(flag, False):
            problems.append(f"drop --{flag.replace('_', '-')} with --kv-prefill tsp (its batches need whole prompts "
                            "and pure decode steps on one rank)")
    if (g("pp_size", 1) or 1) > 1:
        problems.append(f"use --pp-size 1 with --kv-prefill tsp (got {g('pp_size')})")
    if g("disaggregation_mode", "null") not in (None, "null"):
        problems.append(f"drop --disaggregation-mode {g('disaggregation_mode')} with --kv-prefill tsp")
    return problems + _backend_problems(g, "--kv-prefill tsp")


def check_tsp_alone(server_args: Any, config: FreeKVConfig) -> None:
    problems = tsp_alone_problems(server_args, config)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise FreeKVArgsError(f"--kv-prefill tsp cannot run with these server arguments:\n{lines}")


def settings_from_argv(argv: Sequence[str]) -> FreeKVServerSettings | None:
    """Settings from a FreeKV-only argument list (tests, tools)."""
    return settings_from_values(flag_values(freekv_parser().parse_args(list(argv))))


def settings_from_env(environ: Mapping[str, str] | None = None) -> FreeKVServerSettings | None:
    return settings_from_values(env_flag_values(environ))


def _name_flags(message: str) -> str:
    """Put the CLI flag next to FreeKVConfig's field names in its error messages."""
    for dest, (flag, field) in _KNOB_FLAGS.items():
        if message.startswith(field + " ") or message.startswith(field + "="):
            return f"{flag}: {message}"
    return f"invalid FreeKV settings: {message}"


# ----------------------------------------------------------------------------------------------- checks


def preset_server_fields(fields: Mapping[str, Any], settings: FreeKVServerSettings) -> dict[str, Any]:
    """The ServerArgs fields to set before SGLang resolves them: --page-size (to --kv-page-size, or refuse a
    different one) and --attention-backend (to DEFAULT_ATTENTION_BACKEND when no backend was named)."""
    page = settings.config.page_size
    updates: dict[str, Any] = {}
    given = fields.get("page_size")
    if given is None:
        updates["page_size"] = page
    elif given != page:
        raise FreeKVArgsError(
            f"--page-size {given} differs from --kv-page-size {page}: FreeKV's page is SGLang's KV page; "
            f"drop --page-size or pass --page-size {page} (or --kv-page-size {given})"
        )
    backends = ("attention_backend", "decode_attention_backend", "prefill_attention_backend")
    if all(fields.get(k) is None for k in backends):
        updates["attention_backend"] = DEFAULT_ATTENTION_BACKEND
    return updates


def server_args_problems(server_args: Any, settings: FreeKVServerSettings) -> list[str]:
    """Every reason FreeKV cannot run with these (SGLang) server arguments, each naming the flag to change."""
    g = lambda name, default=None: getattr(server_args, name, default)  # noqa: E731
    problems = []
    page = settings.config.page_size
    if g("page_size") not in (None, page):
        problems.append(f"--page-size is {g('page_size')} but FreeKV needs it equal to --kv-page-size {page}")
    if not g("disable_radix_cache", False):  # FreeKV's radix cache shares prefix host pages (docs/radix.md)
        if (g("tp_size", 1) or 1) > 1:
            problems.append(f"pass --disable-radix-cache with --tp-size {g('tp_size')}: FreeKV's radix cache does not "
                            "agree prefix hits across TP ranks yet (each rank has its own kvstore arena)")
        if g("radix_cache_backend") is not None:
            problems.append(f"drop --radix-cache-backend {g('radix_cache_backend')}: FreeKV brings its own radix "
                            "cache (or pass --disable-radix-cache)")
    if g("speculative_algorithm") not in (None, "", "NONE", "none"):
        problems.append(
            f"drop --speculative-algorithm {g('speculative_algorithm')}: speculative decoding (draft models, "
            "multi-token verify) is not supported with FreeKV"
        )
    if g("enable_dp_attention", False):
        problems.append("drop --enable-dp-attention: DP attention is not supported with FreeKV")
    if g("enable_deterministic_inference", False) and settings.config.attention != "backend":
        problems.append(f"pass --kv-attention backend with --enable-deterministic-inference: --kv-attention "
                        f"{settings.config.attention} splits a row's pages by the batch's size, so a request's "
                        "rounding would change with its batch")
    if g("enable_hierarchical_cache", False):
        problems.append(
            "drop --enable-hierarchical-cache: FreeKV already keeps the KV cache in host memory (its kvstore) and "
            "needs the radix cache off"
        )
    if g("enable_memory_saver", False):
        problems.append("drop --enable-memory-saver: FreeKV's GPU pages and staging are not in SGLang's memory saver")
    if g("enable_hisparse", False):
        problems.append("drop --enable-hisparse: HiSparse is another sparse-attention scheme; use one of the two")
    if g("enable_mixed_chunk", False):
        problems.append(
            "drop --enable-mixed-chunk: FreeKV's decode path needs batches that are pure decode (mixed "
            "prefill+decode batches are not supported)"
        )
    if g("disaggregation_mode", "null") not in (None, "null"):
        problems.append(
            f"drop --disaggregation-mode {g('disaggregation_mode')}: prefill/decode disaggregation is not "
            "supported with FreeKV"
        )
    if (g("pp_size", 1) or 1) > 1:
        problems.append(f"use --pp-size 1 (got {g('pp_size')}): pipeline parallelism is not supported with FreeKV yet")
    if g("enable_two_batch_overlap", False):
        problems.append("drop --enable-two-batch-overlap: two-batch overlap is not supported with FreeKV")
    if g("enable_torch_compile", False):
        problems.append("drop --enable-torch-compile: torch.compile would trace FreeKV's decode step (host-planned "
                        "tables, side streams and their events, the early correction's wrapped layers) into the "
                        "compiled forward; the decode CUDA graph serves without it")
    if g("enable_pdmux", False):
        problems.append("drop --enable-pdmux: PD multiplexing is not supported with FreeKV")
    if (g("tokenizer_worker_num", 1) or 1) > 1:
        problems.append(f"use --tokenizer-worker-num 1 (got {g('tokenizer_worker_num')}): FreeKV's /health check of "
                        "its kvstore daemon is installed on the single HTTP process's app")
    kv_dtype = g("kv_cache_dtype", "auto")
    if kv_dtype not in (None, "auto", "bf16", "bfloat16", "fp16", "float16"):
        # FreeKV's kernels write and read 16-bit pages with no KV scales (SGLang divides an FP8 cache's K/V by them)
        problems.append(f"drop --kv-cache-dtype {kv_dtype}: FreeKV keeps a 16-bit KV cache on the GPU; narrow the "
                        "host pages instead (FP8 host pages)")
        if settings.config.host_dtype != "auto":
            problems.append(f"drop --kv-host-dtype {settings.config.host_dtype}: it narrows a 16-bit KV cache, and "
                            f"--kv-cache-dtype is {kv_dtype}")
    if _graph_backend(g, "decode") == "breakable":
        problems.append("--cuda-graph-backend-decode is breakable: FreeKV's decode step is built for one captured "
                        "graph (its side streams join after the whole forward, through capture_tail_hooks), not for "
                        "attention run eagerly between captured segments (drop it: SGLang's default full decode "
                        "graph serves, and so does --disable-decode-cuda-graph)")
    if _graph_backend(g, "prefill") == "full":
        problems.append("--cuda-graph-backend-prefill is full: FreeKV plans each prefill batch's staging and offload "
                        "on the host, which a whole-forward prefill graph would replay from its capture (pass "
                        "--cuda-graph-backend-prefill breakable, SGLang's default on CUDA, or "
                        "--disable-prefill-cuda-graph)")
    if settings.config.prefill == "tsp":
        problems += _tsp_problems(g)
    if settings.config.retrieval == "louiskv" and not g("disable_radix_cache", False):
        problems.append("pass --disable-radix-cache with --kv-retrieval louiskv: LouisKV writes each prompt's host "
                        "pages in the order of its own k-means clusters, so no request can share them as a prefix")
    return problems + _backend_problems(g, "FreeKV", f" (pass {{flag}} {DEFAULT_ATTENTION_BACKEND})")


def _graph_backend(g, phase: str) -> str | None:
    """A phase's CUDA graph backend: --cuda-graph-config's (JSON before SGLang resolves it, which wins over the
    per-phase flag; the resolved config after), else --cuda-graph-backend-{phase}."""
    config = g("cuda_graph_config")
    settings = config.get(phase) if isinstance(config, dict) else getattr(config, phase, None)
    backend = settings.get("backend") if isinstance(settings, dict) else getattr(settings, "backend", None)
    return backend if backend is not None else g(f"cuda_graph_backend_{phase}")


def _backend_problems(g, who: str, hint: str = "") -> list[str]:
    """The attention backends named that `who` cannot wrap; hint may name {flag}."""
    problems = []
    for name in ("attention_backend", "decode_attention_backend", "prefill_attention_backend"):
        value = g(name)
        if value is not None and value not in SUPPORTED_ATTENTION_BACKENDS:
            flag = "--" + name.replace("_", "-")
            problems.append(f"{flag} is {value}: {who} wraps only the {' or '.join(SUPPORTED_ATTENTION_BACKENDS)} "
                            f"attention backends{hint.format(flag=flag)}")
    return problems


def _tsp_problems(g) -> list[str]:
    problems = []
    if not g("disable_radix_cache", False):
        problems.append("pass --disable-radix-cache with --kv-prefill tsp: the layers after the TSP layer hold only "
                        "a prompt's propagated tokens, which no other prompt can share as a prefix")
    if g("chunked_prefill_size") not in (None, -1):
        problems.append(f"pass --chunked-prefill-size -1 with --kv-prefill tsp (got {g('chunked_prefill_size')}): the "
                        "TSP layer picks the propagated tokens from the prompt's last queries, so each prompt is "
                        "prefilled whole in one batch")
    if not g("disable_prefill_cuda_graph", True):
        problems.append("pass --disable-prefill-cuda-graph with --kv-prefill tsp: how many tokens go past the TSP "
                        "layer is known only inside the forward, which a captured prefill graph cannot follow")
    if (g("tp_size", 1) or 1) > 1:
        problems.append(f"use --tp-size 1 with --kv-prefill tsp (got {g('tp_size')}): the TSP layer averages every "
                        "query head's attention, which tensor parallelism splits across ranks")
    return problems


def check_server_args(server_args: Any, settings: FreeKVServerSettings) -> None:
    """Raise FreeKVArgsError listing every problem of server_args_problems."""
    problems = server_args_problems(server_args, settings)
    if problems:
        raise FreeKVArgsError(_refusal(problems, retrieval=settings.config.retrieval))


def model_problems(hf_config: Any, config: FreeKVConfig | None = None) -> list[str]:
    """Why FreeKV cannot serve this (Hugging Face) model config: MLA, sliding-window or other non-full attention
    layers, and the head/layer shapes of FreeKVConfig.check_model."""
    text = _text_config(hf_config)
    g = lambda name, default=None: getattr(text, name, default)  # noqa: E731
    arch = ", ".join(getattr(hf_config, "architectures", None) or []) or type(hf_config).__name__
    problems = []
    if g("kv_lora_rank") is not None or g("use_mla", False):
        problems.append(f"{arch} uses multi-head latent attention (MLA); FreeKV serves MHA/GQA models only")
    layer_types = g("layer_types")
    if isinstance(layer_types, (list, tuple)):
        other = sorted({str(t) for t in layer_types} - {"full_attention", "attention", "global", "full"})
        if other:
            problems.append(f"{arch} has {', '.join(other)} layers; FreeKV serves models whose every layer is "
                            "full attention")
    keys = ("sliding_window", "sliding_window_size", "attention_window_size")
    window = next((g(k) for k in keys if g(k) is not None), None)
    if window is not None and g("use_sliding_window", True) is not False and not isinstance(layer_types, (list, tuple)):
        problems.append(f"{arch} uses sliding-window attention (window {window}); FreeKV serves full-attention "
                        "models only")
    layers, q_heads = g("num_hidden_layers"), g("num_attention_heads")
    if isinstance(layers, int) and isinstance(q_heads, int):
        kv_heads = g("num_key_value_heads") or q_heads
        head_dim = g("head_dim") or (g("hidden_size") // q_heads if isinstance(g("hidden_size"), int) else None)
        try:
            (config or FreeKVConfig()).check_model(layers, q_heads, kv_heads, head_dim)
        except ValueError as e:
            problems.append(_name_flags(str(e)).replace("invalid FreeKV settings: ", ""))
    return problems


def check_model(hf_config: Any, config: FreeKVConfig | None = None) -> None:
    """Raise FreeKVArgsError when FreeKV cannot serve this model (called in each scheduler process once the model
    config is known)."""
    problems = model_problems(hf_config, config)
    if problems:
        raise FreeKVArgsError(_refusal(problems, what="this model", retrieval=(config or FreeKVConfig()).retrieval))


def host_page_bytes(config: FreeKVConfig, *, num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype) -> int:
    """Bytes of one host page: K and V of page_size tokens, every layer and KV head (of one TP rank), in the host
    dtype (--kv-host-dtype) of a KV cache of kv_dtype, FP8 rows' exponents included."""
    from freekv_kvstore import ArenaGeometry

    return ArenaGeometry(num_layers, num_kv_heads, config.page_size, head_dim,
                         config.host_torch_dtype(kv_dtype)).page_bytes


def host_page_capacity(settings: FreeKVServerSettings, *, num_layers: int, num_kv_heads: int, head_dim: int,
                       kv_dtype, tp_size: int = 1) -> int:
    """Host pages one TP rank asks the kvstore for: its share of --kvstore-arena-gb, counted in 1e9 bytes so
    the request stays below the daemon's GiB budget (which also holds the daemon's own bookkeeping)."""
    page_bytes = host_page_bytes(settings.config, num_layers=num_layers, num_kv_heads=num_kv_heads,
                                 head_dim=head_dim, kv_dtype=kv_dtype)
    return int(settings.kvstore_arena_gb * 1e9 / tp_size) // page_bytes


def check_arena_fits(arena_gb: float, shm_dir: str = "/dev/shm") -> None:
    """Refuse an embedded-daemon arena larger than the host's memory or its shared-memory filesystem."""
    import psutil

    want = int(arena_gb * _GiB)
    limits = {"the host's memory": psutil.virtual_memory().total}
    try:
        st = os.statvfs(shm_dir)
        limits[f"{shm_dir}"] = st.f_blocks * st.f_frsize
    except OSError:
        pass
    where, cap = min(limits.items(), key=lambda kv: kv[1])
    if want > cap:
        suggest = max(cap // 2, 1) / _GiB
        raise FreeKVArgsError(
            f"--kvstore-arena-gb {arena_gb:g} does not fit: {where} holds {cap / _GiB:.1f} GiB; pass a smaller "
            f"--kvstore-arena-gb (e.g. {suggest:.1f}) or --kvstore-endpoint of a daemon on a bigger host"
        )


def _text_config(hf_config: Any) -> Any:
    get = getattr(hf_config, "get_text_config", None)
    if callable(get):
        try:
            return get()
        except Exception:  # noqa: BLE001 - odd configs: fall back to the top level
            pass
    return getattr(hf_config, "text_config", None) or hf_config


def _refusal(problems: list[str], what: str = "these server arguments", retrieval: str = "freekv") -> str:
    lines = "\n".join(f"  - {p}" for p in problems)
    return f"--kv-retrieval {retrieval} cannot run with {what}:\n{lines}"
