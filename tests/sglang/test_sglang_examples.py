"""examples/: the frontend programs import and trace without a server; the launch script parses and names every
flag. (Running them needs a GPU server.)"""

import importlib.util
import pathlib
import subprocess

import pytest

from freekv_sglang.server_args import FLAGS

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"freekv_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _nodes(traced):
    return {type(n).__name__: n for n in traced.flatten_nodes()}


def test_long_document_qa_builds():
    from sglang.lang.ir import SglGen, SglSelect

    qa = _load("long_document_qa")
    code = "4821"
    doc = qa.make_document(200, 0.5, code)
    assert doc.count(code) == 1 and doc.index(code) > len(doc) // 3
    choices = qa.make_choices(code)
    assert code in choices and len(set(choices)) == 4
    nodes = [n for n in qa.document_qa.trace(document=doc, question=qa.QUESTION, choices=choices).flatten_nodes()]
    gens = [n for n in nodes if isinstance(n, SglGen)]
    selects = [n for n in nodes if isinstance(n, SglSelect)]
    assert [g.name for g in gens] == ["answer"] and [s.name for s in selects] == ["choice"]
    assert selects[0].choices == choices
    assert callable(qa.main)


def test_long_generation_builds():
    from sglang.lang.ir import SglGen

    gen = _load("long_generation")
    nodes = gen.long_story.trace(topic="a test", max_tokens=4096).flatten_nodes()
    gens = [n for n in nodes if isinstance(n, SglGen)]
    assert [g.name for g in gens] == ["story"]
    assert callable(gen.main)


@pytest.mark.parametrize("name", ["long_document_qa", "long_generation"])
def test_examples_parse_url(name):
    module = _load(name)
    with pytest.raises(SystemExit) as e:  # --help: parses, prints, exits 0 without touching a server
        module.main(["--help"])
    assert e.value.code == 0


def test_launch_script():
    script = EXAMPLES / "launch_freekv_server.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    for flag in (*FLAGS, "--disable-radix-cache", "sglang.launch_server"):
        assert flag in text, flag
