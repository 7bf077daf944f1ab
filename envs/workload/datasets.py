"""Token counts drawn as ``vllm bench serve --dataset-name NAME`` draws them: ``lengths: {kind: dataset, name}``.

vLLM 0.33's datasets (vllm/benchmarks/datasets/datasets.py; the line numbers below are that file's) give each
request a prompt and an expected output length. Only the counts matter to a scheduler, so each is read here as
vLLM reads it, without vLLM:

- ``random`` (RandomDataset, 555-689, with datasets/utils.py:39-99 get_sampling_params): prompt and output
  lengths drawn uniformly from the integers [floor(L·(1 - r)), ceil(L·(1 + r))] around ``input_len`` (1024)
  and ``output_len`` (128), ``range_ratio`` r in [0, 1) (one for both, or ``{input, output}``; default 0); the
  output range at least 1. vLLM first takes the tokenizer's special tokens s off ``input_len`` and the server
  adds them back, so a request holds the draw plus s (s from ``tokenizer`` when given, else 0).
- ``sharegpt`` (ShareGPTDataset, 1327-1414): a JSON list of ``{"conversations": [{"from", "value"}, ...]}``;
  entries with fewer than two turns are dropped (1342-1346), the rest shuffled; the prompt is the first turn,
  the output the second turn's token count unless ``output_len`` fixes it (1385); pairs failing vLLM's
  is_valid_sequence (340-365: prompt or output under 4 tokens, the output check skipped when output_len is
  fixed; prompt over 1024; prompt + output over 2048) are skipped, and when fewer than n remain, the kept ones
  are resampled with replacement (maybe_oversample_requests, 289-330).
- ``burstgpt`` (BurstGPTDataset, 3015-3091): BurstGPT's CSV; rows of model ``GPT-4`` whose ``Response tokens``
  is above 0 (3034-3038), drawn without replacement when there are enough, with it otherwise (3041-3050);
  ``Request tokens`` and ``Response tokens`` are the counts (vLLM reads them as columns 2 and 3, 3066-3067,
  which they are in BurstGPT's header). A kept row with 0 request tokens would be an empty prompt; it is
  dropped, and counted in the description.
- ``custom`` (CustomDataset, 2425-2550): JSON lines ``{"prompt": ..., "output_tokens": ...}``; every line
  used (no filter), shuffled; the output is ``output_tokens`` unless ``output_len`` is given (2505-2523); vLLM
  wraps the prompt in the tokenizer's chat template before counting (2525-2533), which is done here when
  ``transformers`` reads the tokenizer and it has a template.

Token counts of text: with ``tokenizer`` (a local Hugging Face tokenizer folder) and ``transformers`` or
``tokenizers`` installed, counted as vLLM counts them (``len(tokenizer(text).input_ids)``, special tokens
included). Otherwise estimated as ceil(characters / CHARS_PER_TOKEN), at least 1, and the workload's
description says so. The draws come from the workload's generator: the same distribution as vLLM's, not its
exact sample for a seed.
"""
from __future__ import annotations

import csv
import functools
import io
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from servetune.config import MAX_TOKEN_COUNT, LengthsConfig
from servetune.errors import (ConfigError, TraceError, parse_json, parse_json_lines, reading_user_file, show_json,
                              show_text)

# ~4 characters of English text per token: OpenAI's rule of thumb ("1 token ~= 4 chars in English",
# https://help.openai.com/en/articles/4936856-what-are-tokens-and-how-to-count-them): a rough figure for other
# BPE tokenizers such as Llama's too. Code, numbers and non-Latin scripts take more tokens per character, so
# there the estimate runs low.
CHARS_PER_TOKEN = 4.0

# vLLM's RandomDataset defaults (datasets.py:572-575) and is_valid_sequence's (datasets.py:340-346).
RANDOM_INPUT_LEN = 1024
RANDOM_OUTPUT_LEN = 128
RANDOM_RANGE_RATIO = 0.0
MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048
BURSTGPT_MODEL = "GPT-4"
BURSTGPT_COLUMNS = ("Model", "Request tokens", "Response tokens")

TokenCounts = tuple[np.ndarray, np.ndarray, str]


# --------------------------------------------------------------------------------------------- token counts

@dataclass(frozen=True)
class TokenCounter:
    """Counts a text's tokens; ``note`` says how, for the workload's description."""

    count: Callable[[list[str]], list[int]]
    note: str
    num_special_tokens: int = 0        # what the tokenizer adds to a text (a BOS): vLLM's num_special_tokens_to_add
    chat_template: Optional[Callable[[str], str]] = None   # wraps a prompt as a user turn, when the tokenizer has one


def estimated_tokens(texts: list[str]) -> list[int]:
    return [max(1, math.ceil(len(text) / CHARS_PER_TOKEN)) for text in texts]


def _estimate(reason: str) -> TokenCounter:
    return TokenCounter(estimated_tokens, f"token counts estimated at {CHARS_PER_TOKEN:g} characters per token "
                                          f"({reason})")


@functools.lru_cache(maxsize=8)
def token_counter(tokenizer: Optional[str]) -> TokenCounter:
    """The counter for a tokenizer folder (None: the estimate): ``transformers`` (vLLM's own tokenizer loader,
    chat templates included) when installed, else ``tokenizers`` on the folder's tokenizer.json, else the
    estimate."""
    if tokenizer is None:
        return _estimate("no tokenizer given")
    try:
        import transformers  # noqa: F401  (optional)
    except ImportError:
        transformers = None
    if transformers is not None:
        try:
            loaded = transformers.AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
        except Exception as error:   # transformers raises many kinds for a folder it cannot read
            raise TraceError(f"{tokenizer}: not a Hugging Face tokenizer folder transformers can load "
                             f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})") from None
        template = None
        if getattr(loaded, "chat_template", None):
            def template(prompt: str) -> str:
                return loaded.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                  tokenize=False)
        return TokenCounter(lambda texts: [len(ids) for ids in loaded(texts).input_ids],
                            f"token counts from the tokenizer in {Path(tokenizer).name} (transformers)",
                            int(loaded.num_special_tokens_to_add()), template)
    try:
        import tokenizers
    except ImportError:
        return _estimate(f"neither transformers nor tokenizers is installed to read {Path(tokenizer).name}")
    file = Path(tokenizer) / "tokenizer.json"
    try:
        loaded = tokenizers.Tokenizer.from_file(str(file))
    except Exception as error:
        raise TraceError(f"{file}: not a tokenizer file the tokenizers library can load "
                         f"({str(error).splitlines()[0] if str(error) else type(error).__name__})") from None
    return TokenCounter(lambda texts: [len(encoding.ids) for encoding in loaded.encode_batch(texts)],
                        f"token counts from {Path(tokenizer).name}/tokenizer.json (tokenizers; no chat template)",
                        int(loaded.num_special_tokens_to_add(False)))


# ------------------------------------------------------------------------------------------------- random

def range_ratios(range_ratio) -> tuple[float, float]:
    """(input, output) of a range_ratio the loader checked: a number, or {input: r, output: r}
    (vLLM's _resolve_range_ratios, datasets/utils.py:19-36)."""
    if range_ratio is None:
        return RANDOM_RANGE_RATIO, RANDOM_RANGE_RATIO
    if isinstance(range_ratio, (tuple, list)):
        return float(range_ratio[0]), float(range_ratio[1])
    if hasattr(range_ratio, "input"):   # RangeRatioConfig
        return float(range_ratio.input), float(range_ratio.output)
    return float(range_ratio), float(range_ratio)


def random_ranges(input_len: int, output_len: int, range_ratio, num_special_tokens: int = 0
                  ) -> tuple[tuple[int, int], tuple[int, int]]:
    """The inclusive ranges vLLM draws input and output lengths from (datasets/utils.py:62-77)."""
    input_ratio, output_ratio = range_ratios(range_ratio)
    real_input_len = max(0, input_len - num_special_tokens)
    input_low = math.floor(real_input_len * (1 - input_ratio))
    input_high = math.ceil(real_input_len * (1 + input_ratio))
    output_low = max(math.floor(output_len * (1 - output_ratio)), 1)
    output_high = max(math.ceil(output_len * (1 + output_ratio)), 1)
    return (input_low, input_high), (output_low, output_high)


def random_lengths(lengths: LengthsConfig, n: int, rng: np.random.Generator) -> TokenCounts:
    counter = token_counter(lengths.tokenizer) if lengths.tokenizer is not None else None
    special = counter.num_special_tokens if counter is not None else 0
    input_len = RANDOM_INPUT_LEN if lengths.input_len is None else lengths.input_len
    output_len = RANDOM_OUTPUT_LEN if lengths.output_len is None else lengths.output_len
    (input_low, input_high), (output_low, output_high) = random_ranges(input_len, output_len, lengths.range_ratio,
                                                                       special)
    if input_low < 1:   # vLLM's own refusal (datasets.py:600-615)
        raise ConfigError(f"workload.lengths.input_len: got {input_len}, expected enough tokens that "
                          f"floor((input_len - {special} special tokens) · (1 - range_ratio)) ≥ 1, as vLLM requires")
    prompt = rng.integers(input_low, input_high, size=n, endpoint=True, dtype=np.int64) + special
    output = rng.integers(output_low, output_high, size=n, endpoint=True, dtype=np.int64)
    specials = f" plus {special} special tokens" if special else ""
    span = lambda low, high: f"{low}" if low == high else f"{low}-{high}"   # noqa: E731
    return prompt, output, (f"vllm random dataset lengths: prompt {span(input_low, input_high)}{specials} / output "
                            f"{span(output_low, output_high)} tokens")


# ------------------------------------------------------------------------------------------------ files

def _file_key(path: str) -> tuple[str, int, int]:
    """The file and its version: a cached read is reused only while the file is unchanged."""
    try:
        stat = os.stat(path)
    except OSError:
        return path, -1, -1   # reading reports it
    return path, stat.st_mtime_ns, stat.st_size


def _read_text(path: Path, what: str, expected: str) -> str:
    with reading_user_file(path, what, expected, TraceError):
        data = path.read_bytes()
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise TraceError(f"{path}: line {line}: byte {error.start}: not UTF-8 text, expected {expected}") from None


@functools.lru_cache(maxsize=4)
def _sharegpt_pairs(key: tuple[str, int, int]) -> tuple[tuple[str, str], ...]:
    """The (first turn, second turn) of every entry with at least two turns, in file order."""
    path = Path(key[0])
    text = _read_text(path, "ShareGPT dataset", "a ShareGPT JSON file")
    data = parse_json(text, path, "a ShareGPT JSON list of conversations", TraceError)
    if type(data) is not list:
        raise TraceError(f"{path}: got {show_json(data)}, expected a JSON list of {{\"conversations\": [...]}} "
                         "entries (ShareGPT)")
    pairs = []
    for index, entry in enumerate(data):
        # vLLM keeps entries holding "conversations" with two turns or more (datasets.py:1342-1346).
        if type(entry) is not dict or "conversations" not in entry:
            continue
        turns = entry["conversations"]
        if type(turns) is not list:
            raise TraceError(f"{path}: entry {index}: conversations: got {show_json(turns)}, expected a list of "
                             "turns {\"from\": ..., \"value\": TEXT}")
        if len(turns) < 2:
            continue
        texts = []
        for turn_index in (0, 1):
            turn = turns[turn_index]
            if type(turn) is not dict or type(turn.get("value")) is not str:
                raise TraceError(f"{path}: entry {index}: conversations[{turn_index}]: got {show_json(turn)}, "
                                 "expected a turn {\"from\": ..., \"value\": TEXT}")
            texts.append(turn["value"])
        pairs.append((texts[0], texts[1]))
    if not pairs:
        raise TraceError(f"{path}: no entry has conversations of two turns or more; expected ShareGPT's "
                         "[{\"conversations\": [{\"from\": \"human\", \"value\": ...}, {\"from\": \"gpt\", ...}]}]")
    return tuple(pairs)


@functools.lru_cache(maxsize=4)
def _counted_pairs(key: tuple[str, int, int], tokenizer: Optional[str]) -> tuple[np.ndarray, np.ndarray]:
    pairs = _sharegpt_pairs(key)
    count = token_counter(tokenizer).count
    return (np.asarray(count([prompt for prompt, _ in pairs]), dtype=np.int64),
            np.asarray(count([completion for _, completion in pairs]), dtype=np.int64))


def _draw(rng: np.random.Generator, kept: np.ndarray, n: int) -> np.ndarray:
    """vLLM's sample of n from kept rows: shuffled, the first n; when fewer, all of them and then draws with
    replacement from them for the rest (datasets.py:289-330)."""
    order = rng.permutation(kept)
    if len(order) >= n:
        return order[:n]
    return np.concatenate([order, rng.choice(order, size=n - len(order))])


def sharegpt_lengths(lengths: LengthsConfig, n: int, rng: np.random.Generator) -> TokenCounts:
    key = _file_key(lengths.path)
    prompt, completion = _counted_pairs(key, lengths.tokenizer)
    fixed = lengths.output_len
    output = completion if fixed is None else np.full(len(prompt), fixed, np.int64)
    valid = ((prompt >= MIN_LEN) & ((output >= MIN_LEN) | (fixed is not None)) & (prompt <= MAX_PROMPT_LEN)
             & (prompt + output <= MAX_TOTAL_LEN))
    kept = np.flatnonzero(valid)
    if len(kept) == 0:
        raise TraceError(f"{lengths.path}: none of its {len(prompt)} conversations passes vLLM's filter (prompt and "
                         f"output ≥ {MIN_LEN} tokens, prompt ≤ {MAX_PROMPT_LEN}, both ≤ {MAX_TOTAL_LEN}); "
                         f"{token_counter(lengths.tokenizer).note}")
    rows = _draw(rng, kept, n)
    outputs = f"output {fixed} tokens" if fixed is not None else "the replies' output lengths"
    return (prompt[rows], output[rows],
            f"vllm sharegpt dataset {Path(lengths.path).name} ({len(kept)} of {len(prompt)} conversations pass "
            f"vLLM's length filter; {outputs}; {token_counter(lengths.tokenizer).note})")


@functools.lru_cache(maxsize=4)
def _burstgpt_rows(key: tuple[str, int, int]) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Request and response tokens of the GPT-4 rows with a response, as vLLM keeps them; how many rows the
    file has, and how many kept rows had 0 request tokens (dropped)."""
    path = Path(key[0])
    text = _read_text(path, "BurstGPT dataset", "a BurstGPT CSV file")
    reader = csv.reader(io.StringIO(text, newline=""))
    requests, responses = [], []
    total = empty = 0
    expected = f"an integer in [0, {MAX_TOKEN_COUNT}]"
    try:
        header = next((record for record in reader if record), None)
        if header is None:
            raise TraceError(f"{path}: the BurstGPT file is empty")
        header = [name.strip() for name in header]
        missing = [name for name in BURSTGPT_COLUMNS if name not in header]
        if missing:
            raise TraceError(f"{path}: line {reader.line_num}: the header lacks {', '.join(map(repr, missing))}; "
                             f"expected BurstGPT's columns, among them {', '.join(BURSTGPT_COLUMNS)}")
        model_at, request_at, response_at = (header.index(name) for name in BURSTGPT_COLUMNS)
        for record in reader:
            if not record:
                continue
            total += 1
            where = f"{path}: row {total} (line {reader.line_num})"
            if len(record) != len(header):
                raise TraceError(f"{where}: got {len(record)} fields, expected {len(header)} like the header")
            counts = []
            for name, at in (("Request tokens", request_at), ("Response tokens", response_at)):
                value = record[at].strip()
                # pandas reads BurstGPT's counts as integers (some exports write 12.0).
                number = value[:-2] if value.endswith(".0") else value
                if not (number.isascii() and number.isdigit() and len(number) <= 9 and int(number) <= MAX_TOKEN_COUNT):
                    raise TraceError(f"{where}: {name}: got {show_text(value)}, expected {expected}")
                counts.append(int(number))
            if record[model_at].strip() != BURSTGPT_MODEL or counts[1] <= 0:
                continue
            if counts[0] == 0:
                empty += 1
                continue
            requests.append(counts[0])
            responses.append(counts[1])
    except csv.Error as error:
        raise TraceError(f"{path}: line {reader.line_num}: unreadable CSV ({error})") from None
    if not requests:
        raise TraceError(f"{path}: none of its {total} rows is a {BURSTGPT_MODEL} request with a response and a "
                         "prompt, which is all vLLM's BurstGPT dataset uses")
    return np.asarray(requests, np.int64), np.asarray(responses, np.int64), total, empty


def burstgpt_lengths(lengths: LengthsConfig, n: int, rng: np.random.Generator) -> TokenCounts:
    requests, responses, total, empty = _burstgpt_rows(_file_key(lengths.path))
    rows = rng.choice(len(requests), size=n, replace=n > len(requests))
    dropped = f"; {empty} with 0 request tokens dropped" if empty else ""
    return (requests[rows], responses[rows],
            f"vllm burstgpt dataset {Path(lengths.path).name} ({len(requests)} of {total} rows: {BURSTGPT_MODEL} "
            f"with a response{dropped})")


@functools.lru_cache(maxsize=4)
def _custom_lines(key: tuple[str, int, int]) -> tuple[tuple[str, Optional[int], str], ...]:
    """(prompt, output_tokens or None, where) per line of a custom JSONL dataset."""
    path = Path(key[0])
    text = _read_text(path, "custom dataset", "a JSONL file of {\"prompt\": ..., \"output_tokens\": ...} lines")
    items = []
    for where, item in parse_json_lines(path, text, "a JSON object with a \"prompt\""):
        if type(item.get("prompt")) is not str:
            raise TraceError(f"{where}: prompt: got {show_json(item.get('prompt'))}, expected the prompt's text "
                             "(vLLM's custom dataset needs a \"prompt\" in every line)")
        output = item.get("output_tokens")
        if output is not None and not (type(output) is int and 1 <= output <= MAX_TOKEN_COUNT):
            raise TraceError(f"{where}: output_tokens: got {show_json(output)}, expected an integer in "
                             f"[1, {MAX_TOKEN_COUNT}]")
        items.append((item["prompt"], output, where))
    if not items:
        raise TraceError(f"{path}: the custom dataset has no lines")
    return tuple(items)


@functools.lru_cache(maxsize=4)
def _counted_custom(key: tuple[str, int, int], tokenizer: Optional[str]) -> np.ndarray:
    counter = token_counter(tokenizer)
    prompts = [prompt for prompt, _, _ in _custom_lines(key)]
    if counter.chat_template is not None:
        prompts = [counter.chat_template(prompt) for prompt in prompts]
    return np.asarray(counter.count(prompts), dtype=np.int64)


def custom_lengths(lengths: LengthsConfig, n: int, rng: np.random.Generator) -> TokenCounts:
    key = _file_key(lengths.path)
    items = _custom_lines(key)
    prompt = _counted_custom(key, lengths.tokenizer)
    if lengths.output_len is not None:
        output = np.full(len(items), lengths.output_len, np.int64)
    else:
        missing = next((where for _, tokens, where in items if tokens is None), None)
        if missing is not None:
            raise TraceError(f"{missing}: output_tokens: missing, expected an integer in [1, {MAX_TOKEN_COUNT}] in "
                             "every line, or workload.lengths.output_len (vLLM's --custom-output-len)")
        output = np.asarray([tokens for _, tokens, _ in items], dtype=np.int64)
    rows = _draw(rng, np.arange(len(items)), n)
    counter = token_counter(lengths.tokenizer)
    template = "; chat template applied" if counter.chat_template is not None else ""
    outputs = f"output {lengths.output_len} tokens" if lengths.output_len is not None else "its output_tokens"
    return (prompt[rows], output[rows], f"vllm custom dataset {Path(lengths.path).name} ({len(items)} prompts; "
                                        f"{outputs}; {counter.note}{template})")


DATASET_SAMPLERS: dict[str, Callable[[LengthsConfig, int, np.random.Generator], TokenCounts]] = {
    "random": random_lengths,
    "sharegpt": sharegpt_lengths,
    "burstgpt": burstgpt_lengths,
    "custom": custom_lengths,
}


def dataset_lengths(lengths: LengthsConfig, n: int, rng: np.random.Generator) -> TokenCounts:
    return DATASET_SAMPLERS[lengths.name](lengths, n, rng)
