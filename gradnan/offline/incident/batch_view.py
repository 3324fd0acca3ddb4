"""``gradnan batch FILE``: a micro-batch the rerun kept (``batches/<rank>/<when>_mb<M>.pt``), shown: each
tensor's shape and dtype, the token ids of each sample (bounded), their text where a tokenizer is given,
and where in the sequence the forward origin's output first went non-finite, where the ``rerun`` record
that kept the file says so (``nonfinite_at``).

The file is untrusted: it is loaded as ``bundle.load_tensors`` loads tensors (no code run, sizes checked).
Megatron's activations are sequence-first (``[sequence, batch, ...]``): an origin output of that shape,
or batch-first ``[batch, sequence, ...]``, maps onto (sample, token position) of the micro-batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ...errors import InputError
from ...formats.bundle import load_tensors
from ...formats.incident import RecordKind
from ...formats.layout import BATCHES_DIR, RECORDS_DIR
from ...formats.text import printable_lines, untrusted
from .read import read_run

MAX_SAMPLES_SHOWN = 8
MAX_TOKENS_SHOWN = 64
MAX_TENSORS_SHOWN = 16
TOKEN_NAMES = ("tokens", "input_ids", "text")  # what Megatron-LM's and Hugging Face's batches call them


def token_tensor(tensors: Dict[str, Any]) -> Optional[Tuple[str, Any]]:
    """The micro-batch's token ids: a 2-d integer tensor named as batches name them, else the first 2-d
    integer tensor; only a dense one with its values on the CPU (not sparse, quantized or meta), as a data
    loader yields them."""
    import torch

    candidates = [(name, t) for name, t in tensors.items()
                  if t.dim() == 2 and t.layout == torch.strided and t.device.type == "cpu"
                  and not t.is_quantized and not t.is_floating_point() and not t.is_complex()
                  and t.dtype != torch.bool]
    named = [item for item in candidates if item[0].rsplit(".", 1)[-1] in TOKEN_NAMES]
    found = named or candidates
    return found[0] if found else None


def load_tokenizer(name: str) -> Callable[[List[int]], str]:
    """A decoder of token ids: a ``tokenizer.json`` file through the ``tokenizers`` package, else a Hugging
    Face tokenizer name or directory through ``transformers``; InputError where neither can load it."""
    if Path(name).is_file():
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise InputError(f"--tokenizer {name}: a tokenizer file needs the 'tokenizers' package"
                             " (pip install tokenizers)") from None
        try:
            tokenizer = Tokenizer.from_file(name)
        except Exception as exc:
            raise InputError(f"--tokenizer {name}: not a tokenizers file ({type(exc).__name__})") from None
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise InputError(f"--tokenizer {name}: not a file, and a tokenizer name needs the 'transformers'"
                         " package (pip install transformers)") from None
    try:
        pretrained = AutoTokenizer.from_pretrained(name)
    except Exception as exc:
        raise InputError(f"--tokenizer {name}: cannot load it ({type(exc).__name__})") from None
    return lambda ids: pretrained.decode(ids)


def _resolved(path: Any) -> Optional[Path]:
    """``path`` with its links resolved; None for one that cannot be (a NUL, a link loop, too long)."""
    try:
        return Path(path).resolve()
    except (OSError, RuntimeError, ValueError, TypeError):
        return None


def kept_by(path: Path) -> Optional[Dict[str, Any]]:
    """The ``rerun`` record that kept this file, from the run directory it sits in, if it names it."""
    wanted = _resolved(path)
    if wanted is None:
        return None
    run_dir = wanted.parent.parent.parent
    if wanted.parent.parent.name != BATCHES_DIR or not (run_dir / RECORDS_DIR).is_dir():
        return None
    return next((record for record in read_run(run_dir, params=False).all_records()
                 if record.get("kind") == RecordKind.RERUN and isinstance(record.get("batch"), dict)
                 and _resolved(record["batch"]["path"]) == wanted), None)


def nonfinite_position(element: Dict[str, Any], samples: int, length: int) -> Optional[Tuple[int, int]]:
    """(sample, token position) in a ``samples`` x ``length`` micro-batch of an origin output's element,
    sequence-first as Megatron's activations are, else batch-first; None if its shape is neither."""
    shape, index = element["shape"], element["index"]
    if len(shape) < 2 or len(index) < 2 or not all(0 <= i < n for i, n in zip(index[:2], shape[:2])):
        return None
    if shape[:2] == [length, samples]:
        return index[1], index[0]
    if shape[:2] == [samples, length]:
        return index[0], index[1]
    return None


def _sample_lines(row_ids: Any, row: int, label: str, decode: Optional[Callable[[List[int]], str]],
                  mark: Optional[int]) -> List[str]:
    """One sample's first ``MAX_TOKENS_SHOWN`` ids (only those are read and decoded: a row may hold
    hundreds of millions), ``mark`` in brackets."""
    shown: List[int] = row_ids[:MAX_TOKENS_SHOWN].tolist()
    more = f" ... ({len(row_ids) - len(shown)} more)" if len(row_ids) > len(shown) else ""
    marked = " ".join(f"[{token}]" if i == mark else str(token) for i, token in enumerate(shown))
    lines = [f"  sample {row}{label}: {marked}{more}"]
    if decode is not None:
        lines.append(f"    text{' of those' if more else ''}: {_decoded(decode, shown)}")
    return lines


def _decoded(decode: Callable[[List[int]], str], ids: List[int]) -> str:
    """The tokenizer's text of ``ids``, or why it has none (an id past its vocabulary, a negative one)."""
    try:
        return untrusted(repr(decode(ids)))
    except Exception as exc:  # the tokenizer's own error for ids it does not know: a note, not a crash
        return f"not decoded ({type(exc).__name__}: ids outside this tokenizer's vocabulary?)"


def format_batch(path: Path, tokenizer: Optional[str] = None) -> str:
    """The text ``gradnan batch`` prints."""
    import torch

    decode = load_tokenizer(tokenizer) if tokenizer else None
    tensors = load_tensors(path)
    lines = [f"micro-batch {path}: {len(tensors)} tensor(s)"]
    lines += [f"  {untrusted(name)}: {list(t.shape)} {str(t.dtype).replace('torch.', '')}"
              + ("" if t.layout == torch.strided else f" ({str(t.layout).replace('torch.', '')})")
              for name, t in list(tensors.items())[:MAX_TENSORS_SHOWN]]
    if len(tensors) > MAX_TENSORS_SHOWN:
        lines.append(f"  ... and {len(tensors) - MAX_TENSORS_SHOWN} more tensor(s)")
    found = token_tensor(tensors)
    if found is None:
        return printable_lines(lines + ["No 2-d integer tensor of token ids in it."])
    name, ids = found
    record = kept_by(path)
    element = (record or {}).get("nonfinite_at")
    at = nonfinite_position(element, ids.shape[0], ids.shape[1]) if element else None
    indices = ((record or {}).get("samples") or {}).get("indices") or []
    legend = " ([n]: where the value went non-finite)" if at else ""
    lines.append(f"Token ids ({untrusted(name)}), one sample a line{legend}:")
    for row in range(min(ids.shape[0], MAX_SAMPLES_SHOWN)):
        label = f" (global sample {untrusted(indices[row])})" if row < len(indices) else ""
        lines += _sample_lines(ids[row], row, label, decode, at[1] if at and at[0] == row else None)
    if ids.shape[0] > MAX_SAMPLES_SHOWN:
        lines.append(f"  ... and {ids.shape[0] - MAX_SAMPLES_SHOWN} more sample(s) not shown")
    lines += _position_lines(record, element, at, indices)
    return printable_lines(lines)


def _position_lines(record: Optional[Dict[str, Any]], element: Optional[Dict[str, Any]],
                    at: Optional[Tuple[int, int]], indices: Sequence[int]) -> List[str]:
    if record is None:
        return ["Where it went non-finite: unknown (no rerun record in this run directory names this file)"]
    if element is None:
        return ["Where it went non-finite: unknown (the rerun captured no forward origin on this rank)"]
    if at is None:
        return [f"Where it went non-finite: {untrusted(record.get('module'))} output {element['output']}"
                f" element {element['index']} of shape {element['shape']}, which is not [sequence, batch,"
                " ...] of this micro-batch"]
    sample = f" (global sample {untrusted(indices[at[0]])})" if at[0] < len(indices) else ""
    return [f"Where it went non-finite: {untrusted(record.get('module'))} output, sample {at[0]}{sample},"
            f" token position {at[1]}"]
