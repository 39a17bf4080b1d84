"""How --data is read into records: a local file (JSONL, a JSON array, Parquet), a folder's train and test
files, or a hub dataset; each record with the place it came from ("path:line"), so that a mistake in the user's
data is one DataError naming the file, line and column. tasks.py turns records into samples."""
import json
import os
import re

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
HUB_TIMEOUT = 10   # seconds to ask the hub whether a --data name is a dataset of its


class DataError(ValueError):
    """The user's data is not what the task reads (a missing file, column or split, a malformed record): the
    message names the file, line and column, and the run stops with it alone (run_setup.load_prompts)."""


def data_file(data: str, split: str) -> str | None:
    """-> the file of `split` ("train" or "test") that --data names, or None for a test split it lacks.
    --data is a folder holding {train,test}.{jsonl,json,parquet} (the layout of the GSM8K release; the first
    found, in that order), or a file: one whose name has the word "train" or "test" (gsm_train_v2.jsonl)
    finds the other split by swapping that word; any other file is the train split alone."""
    if os.path.isdir(data):
        candidates = [os.path.join(data, f"{split}{ext}") for ext in DATA_SUFFIXES]
    elif os.path.islink(data) and not os.path.exists(data):
        raise DataError(f"--data {data}: a broken symbolic link (to {os.readlink(data)})")
    elif not os.path.isfile(data):
        raise DataError(f"--data {data}: no such file or folder")
    elif not data.endswith(DATA_SUFFIXES):
        raise DataError(f"--data {data}: not a JSONL or Parquet file (.jsonl, .json, .parquet), nor a folder")
    else:
        name, other = os.path.basename(data), "test" if split == "train" else "train"
        # the word alone, not inside another one ("contest")
        word = lambda w: rf"(?<![a-zA-Z]){w}(?![a-zA-Z])"
        if re.search(word(split), name):
            candidates = [data]
        elif re.search(word(other), name):
            candidates = [os.path.join(os.path.dirname(data), re.sub(word(other), split, name))]
        else:
            candidates = [data] if split == "train" else []
    for path in candidates:
        if os.path.isfile(path):
            return path
    if split == "test":
        return None
    raise DataError(f"--data {data}: no {split} split (looked for {', '.join(candidates)})")


def utf8(path: str, line: int, raw: bytes) -> str:
    """raw (line `line` of `path` on) as text; a DataError naming the line and column of a byte not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        at, column = line + raw.count(b"\n", 0, e.start), e.start - raw.rfind(b"\n", 0, e.start)
        raise DataError(f"{path}:{at}: not UTF-8 text (byte {raw[e.start]:#04x} at column {column}): save "
                        f"the file as UTF-8") from None


def json_value(path: str, line: int, text: str, what: str):
    """The JSON value of `text` (from line `line` of `path` on), or a DataError naming the line: `what` the
    text is not."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        hint = "; a .json file holds one JSON array of records, or one record a line" * (
            what == "a JSON line" and path.endswith(".json"))
        where = f"{path}:{line + e.lineno - 1}"
        raise DataError(f"{where}: not {what} ({e.msg}, column {e.colno}){hint}") from None
    # json's limits beyond its syntax: Python's on an integer's digits (a ValueError), and its own stack
    # on values nested in values (100,000 `[`)
    except RecursionError:
        raise DataError(f"{path}:{line}: not {what} that can be read (nested too deep)") from None
    except ValueError as e:
        raise DataError(f"{path}:{line}: not {what} that can be read ({str(e).split(':')[0]})") from None


def no_lone_surrogate(where: str, value) -> None:
    """A JSON escape (\\ud800) can be half of a UTF-16 pair, which is no text (a tokenizer raises TypeError
    on it): a DataError naming `where` if `value` holds one (asked where the text read has a "\\ud")."""
    half = re.search(r"[\ud800-\udfff]", json.dumps(value, ensure_ascii=False))
    if half:
        raise DataError(f"{where}: holds a lone surrogate ({ascii(half[0])}, half of a UTF-16 pair), which is "
                        f"no text")


def read_records(path: str) -> list[tuple[str, dict]]:
    """(where, record) for each record of a JSONL, JSON or Parquet file, where = "path:line" (or "path row
    i"), so that an error names the place. A .json file that starts with `[` is one JSON array of records
    (json.dump's layout); any other is JSON lines. A bad line (not JSON, not UTF-8), a file that cannot be
    read or an unreadable Parquet file is a DataError naming the file and line."""
    if path.endswith(".parquet"):
        import pyarrow
        import pyarrow.parquet
        try:
            rows = pyarrow.parquet.read_table(path).to_pylist()
        except (pyarrow.ArrowException, OSError) as e:
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DataError(f"{path}: not a readable Parquet file ({why})") from None
        return [(f"{path} row {i}", r) for i, r in enumerate(rows, 1)]
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror or type(e).__name__})") from None
    if path.endswith(".json") and raw.lstrip()[:1] == b"[":
        text = utf8(path, 1, raw)
        out = [(f"{path} row {i}", r) for i, r in enumerate(json_value(path, 1, text, "JSON"), 1)]
        for where, r in out if "\\ud" in text.lower() else ():
            no_lone_surrogate(where, r)
        return out
    out = []
    for i, line in enumerate(raw.split(b"\n"), 1):
        if (text := utf8(path, i, line)).strip():
            out.append((f"{path}:{i}", json_value(path, i, text, "a JSON line")))
            if "\\ud" in text.lower():
                no_lone_surrogate(f"{path}:{i}", out[-1][1])
    return out


def local_records(data: str, split: str) -> list[tuple[str, dict]] | None:
    """read_records of the file of `split` that --data names (one without records is a DataError); None for a
    test split it does not have."""
    path = data_file(data, split)
    if path is None:
        return None
    if not (records := read_records(path)):
        where = "" if path == data else f" in {path}"
        raise DataError(f"--data {data}: no records{where} (an empty file)")
    return records


def hub_records(data: str, split: str, config: str | None = None,
                lead: str | None = None) -> list[tuple[str, dict]] | None:
    """(where, record) of `split` of hub dataset `data` (its `config`; None for a test split it lacks; needs
    the internet once, cached by datasets afterwards). The hub is asked first, within HUB_TIMEOUT, whether it
    has that dataset: a name it does not know, or a hub it cannot reach, is one DataError, where datasets
    would retry for 25-35 s and end in a ConnectionError. With HF_HUB_OFFLINE=1, datasets' cache alone
    answers. lead: what an error says first (a --data name's: no such file or folder)."""
    import datasets
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, RepositoryNotFoundError
    from huggingface_hub.utils import validate_repo_id
    missing = lead or f"--data {data}: no such file or folder"
    # no name of the hub's (data/sub/my_set): offline, datasets would look for it as a local folder
    try:
        validate_repo_id(data)
    except HFValidationError:
        raise DataError(f"{missing}, nor a dataset on the hub") from None
    if not datasets.config.HF_HUB_OFFLINE:
        try:
            HfApi().dataset_info(data, timeout=HUB_TIMEOUT)
        except (RepositoryNotFoundError, HFValidationError):
            raise DataError(f"{missing}, nor a dataset on the hub") from None
        except HfHubHTTPError:   # gated, private...: datasets says what it needs
            pass
        # the network's own errors (httpx's or requests', by huggingface_hub version)
        except Exception as e:
            raise DataError(f"{missing}, and the hub cannot be reached to look for a dataset of that name "
                            f"({type(e).__name__}); HF_HUB_OFFLINE=1 reads one from datasets' cache") from None
    try:
        splits = datasets.load_dataset(data, config)
    except datasets.exceptions.DatasetNotFoundError:
        raise DataError(f"{missing}, nor a dataset on the hub") from None
    except ConnectionError as e:   # offline, and not in the cache
        raise DataError(f"{missing}, nor a dataset in datasets' cache ({e})") from None
    # a dataset of several configs, without one or with one it lacks: datasets' message lists them
    except ValueError as e:
        if not (configs := re.search(r"(?:configs|Available): \[(.*?)\]", str(e))):
            raise
        configs = configs[1].replace("'", "")
        raise DataError(f"--data {data}{':' + config if config else ''}: the hub dataset's configs are "
                        f"{configs}: name one, as --data {data}:{configs.split(',')[0]}") from None
    if split == "train" and split not in splits:
        raise DataError(f"--data {data}: no train split (the hub dataset has {', '.join(splits)})")
    return [(f"{data} {split} row {i}", r) for i, r in enumerate(splits[split], 1)] \
        if split in splits else None
