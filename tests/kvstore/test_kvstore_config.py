"""Daemon settings, endpoints, the CLI surface and prefix keys, in process."""

from __future__ import annotations

import os

import numpy as np
import pytest

from freekv_kvstore import DaemonConfig, prefix_keys
from freekv_kvstore.__main__ import main
from freekv_kvstore.config import ensure_private_dir, ipc_path

pytestmark = pytest.mark.timeout(60)


def test_equal_prefixes_give_equal_keys():
    a = prefix_keys(list(range(70)), 16)
    b = prefix_keys(np.arange(64, dtype=np.int32), 16)
    assert len(a) == 4 and a == b and all(len(k) == 16 for k in a)  # the partial page gets no key
    c = prefix_keys([*range(40), 999, *range(41, 64)], 16)
    assert c[:2] == a[:2] and c[2] != a[2] and c[3] != a[3]  # a changed token changes its page and all after
    assert prefix_keys(range(64), 16, namespace=b"other-model") != a
    assert prefix_keys([], 16) == [] and prefix_keys([1, 2], 16) == []


def test_a_chain_continued_from_its_parent_key_equals_the_whole_chain():
    tokens = list(range(7, 7 + 16 * 9 + 5))
    whole = prefix_keys(tokens, 16, namespace=b"m")
    for done in (1, 4, 8):
        assert prefix_keys(tokens[16 * done:], 16, parent=whole[done - 1]) == whole[done:]
    assert prefix_keys(tokens[16 * 4:], 16, parent=prefix_keys(tokens, 16)[3]) != whole[4:]  # another namespace


@pytest.mark.parametrize("tokens, page_size, kw", [([1], 0, {}), ([1], True, {}), ([[1, 2]], 1, {}), ([1.5], 1, {}),
                                                   ([1], 1, dict(parent=b"short")),
                                                   ([1], 1, dict(parent=bytes(16), namespace=b"m"))])
def test_prefix_keys_refuse_bad_input(tokens, page_size, kw):
    with pytest.raises(ValueError):
        prefix_keys(tokens, page_size, **kw)


def test_default_liveness_bound_is_within_five_seconds():
    cfg = DaemonConfig(endpoint="ipc:///tmp/x.sock")
    assert cfg.client_timeout_s + cfg.reap_interval_s <= 5.0
    assert cfg.arena_bytes > 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(endpoint="tcp://127.0.0.1:5555"), "need a token"),
        (dict(endpoint="http://x"), "ipc://"),
        (dict(endpoint="ipc://" + "/x" * 60), "longer than"),
        (dict(arena_bytes=0), "positive"),
        (dict(log_level="loud"), "log_level"),
        (dict(heartbeat_interval_s=2.0, client_timeout_s=3.0), "twice"),
        (dict(token=""), "non-empty"),
        (dict(shm_dir="/nonexistent"), "does not exist"),
    ],
)
def test_config_refuses_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DaemonConfig(**{"endpoint": "ipc:///tmp/x.sock", **kwargs})


def test_ipc_paths_are_made_absolute():
    assert ipc_path("ipc://rel.sock") == os.path.abspath("rel.sock")
    assert ipc_path("tcp://127.0.0.1:1") is None


def test_a_runtime_dir_open_to_others_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(PermissionError, match="mode 0700"):
        ensure_private_dir(str(shared))
    private = tmp_path / "private"
    ensure_private_dir(str(private))
    assert (private.stat().st_mode & 0o777) == 0o700


def test_cli_help_and_errors(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--endpoint", "--arena-gb", "--token", "--log-level", "--stop", "--stats"):
        assert flag in out
    with pytest.raises(SystemExit) as exc:
        main(["--endpoint", "tcp://127.0.0.1:0"])
    assert exc.value.code == 2 and "need a token" in capsys.readouterr().err
    assert main(["--ping", "--endpoint", f"ipc://{tmp_path}/none.sock"]) == 1
    assert "no kvstore listens" in capsys.readouterr().err
