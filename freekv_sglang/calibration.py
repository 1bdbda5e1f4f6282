"""The calibration text of selection "channels": Python's own argparse source (code and English prose, on every
machine that runs Python, and nothing a benchmark task generates), its first CALIBRATION_TOKENS tokens.

On SmolLM2-135M, channels calibrated from it, from uniformly random token ids or from a task's own prompt scored
alike (docs/results/session23): the calibration picks the channels a model's queries weigh and its keys spread on,
which are properties of the model more than of the text.
"""

from __future__ import annotations

import argparse
import inspect

CALIBRATION_TOKENS = 4096


def calibration_ids(tokenizer, num_tokens: int = CALIBRATION_TOKENS) -> list[int]:
    """The calibration text's first num_tokens token ids (the text repeats if a tokenizer packs it shorter)."""
    text = inspect.getsource(argparse)[: num_tokens * 8]  # a token is rarely longer: no tokenizer length warning
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return (ids * (num_tokens // max(len(ids), 1) + 1))[:num_tokens]
