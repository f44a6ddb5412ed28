"""Read and write rows as parquet, JSON Lines or a JSON list.

Parquet cannot hold free-form dicts faithfully: pyarrow turns a column of dicts into a struct
whose fields are the union of all keys, so a key present in one row shows up as ``None`` in
every other row.  :func:`write_rows` therefore stores every column that is not a plain,
uniformly typed scalar column as JSON text, and lists those columns in the file's schema
metadata (key ``polyrl.json_columns``); :func:`read_rows` decodes them, so
``read_rows(p) == rows`` after ``write_rows(rows, p)``.

Image bytes survive too. A column whose values are lists of images -- ``{"bytes": ...,
"path": ...}`` dicts (verl's and HF ``datasets``' layout), raw ``bytes`` or PIL images -- or
lists of such lists (videos as frame lists) is stored natively as parquet
``list<struct<bytes: binary, path: string>>`` (one more list level for videos), as verl's
preprocess scripts write it, and listed under ``polyrl.media_columns``; it reads back as
``[{"bytes": ...}]`` (a PIL image comes back as its PNG bytes). JSON has no bytes: there, image
bytes are written as base64 text, which :func:`polyrl.core.multimodal.decode_image` reads.

Parquet files written by other tools (pandas / pyarrow / verl's preprocess scripts, with
struct, list and map columns) are read too.  For those, keys whose value is ``None`` inside
struct-typed values are dropped, because that is how parquet pads the keys a row did not
have; a pandas index column is dropped as well.
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

JSON_COLUMNS_KEY = b"polyrl.json_columns"
FORMAT_KEY = b"polyrl.format"
FORMAT_VERSION = b"1"
MEDIA_COLUMNS_KEY = b"polyrl.media_columns"
NUM_ROWS_KEY = b"polyrl.num_rows"  # a table without columns (rows of {}) keeps no row count
SUFFIXES: tuple[str, ...] = (".parquet", ".jsonl", ".json")
"""File suffixes understood by :func:`read_rows` / :func:`write_rows`."""

# A JSON-encoded cell whose row lacked the key is stored as a parquet null; a present
# value of None is stored as the JSON text "null".  That keeps "missing" and "None" apart.
_PRIMITIVES: tuple[type, ...] = (bool, int, float, str)


def _suffix(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise ValueError(
            f"unsupported data file {str(path)!r}: expected a name ending in one of {SUFFIXES}"
        )
    return suffix


def _is_pil(value: Any) -> bool:
    # By module name, so that rows without images never import Pillow.
    return type(value).__module__.startswith("PIL.") and hasattr(value, "save")


def _png_bytes(image: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _to_jsonable(value: Any, where: str) -> Any:
    """Convert numpy scalars/arrays and tuples to JSON types; reject what JSON would mangle.

    Bytes (image bytes) and PIL images become base64 text (PNG for an image).
    """
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode("ascii")
    if _is_pil(value):
        return base64.b64encode(_png_bytes(value)).decode("ascii")
    if isinstance(value, int | float):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{where}: non-finite float {value!r} cannot be stored as JSON")
        return value
    if isinstance(value, np.generic):
        return _to_jsonable(value.item(), where)
    if isinstance(value, np.ndarray):
        return [_to_jsonable(v, f"{where}[{i}]") for i, v in enumerate(value.tolist())]
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(
                    f"{where}: dict keys must be strings to be stored, got key {k!r} "
                    f"of type {type(k).__name__}"
                )
            out[k] = _to_jsonable(v, f"{where}.{k}")
        return out
    if isinstance(value, list | tuple):
        return [_to_jsonable(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise TypeError(
        f"{where}: value of type {type(value).__name__} cannot be stored; expected None, bool, "
        "int, float, str, list, dict or a numpy scalar/array"
    )


def _check_rows(rows: Any) -> list[Mapping[str, Any]]:
    if isinstance(rows, Mapping) or isinstance(rows, str | bytes):
        raise TypeError(f"rows must be a list of dicts, got {type(rows).__name__}")
    rows = list(rows)
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise TypeError(f"row {i} must be a dict, got {type(row).__name__}")
        for k in row:
            if not isinstance(k, str):
                raise TypeError(f"row {i}: column names must be strings, got {k!r}")
    return rows


def _atomic_write(path: Path, write: Any) -> None:
    """Run ``write(tmp_path)`` then rename the temp file over ``path``.

    Readers never see a half-written file, and a failed write leaves the old file intact.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _column_names(rows: list[Mapping[str, Any]]) -> list[str]:
    names: dict[str, None] = {}
    for row in rows:
        for k in row:
            names.setdefault(k, None)
    return list(names)


def _native_type(values: list[Any]) -> type | None:
    """Return the single primitive type of a column if it can be stored natively, else None."""
    kinds = {type(v) for v in values}
    if len(kinds) != 1:
        return None
    kind = kinds.pop()
    return kind if kind in _PRIMITIVES else None


_MEDIA_STRUCT = pa.struct([pa.field("bytes", pa.binary()), pa.field("path", pa.string())])


def _media_item(value: Any) -> dict[str, Any] | None:
    """One image as ``{"bytes", "path"}``, or ``None`` when ``value`` is not an image."""
    if isinstance(value, bytes | bytearray | memoryview):
        return {"bytes": bytes(value), "path": None}
    if _is_pil(value):
        return {"bytes": _png_bytes(value), "path": None}
    if isinstance(value, Mapping) and value and set(value) <= {"bytes", "path"}:
        data, path = value.get("bytes"), value.get("path")
        if (data is None or isinstance(data, bytes | bytearray)) and (
            path is None or isinstance(path, str)
        ):
            return {"bytes": None if data is None else bytes(data), "path": path}
    return None


def _image_list(value: Any) -> list[dict[str, Any]] | None:
    if not isinstance(value, list | tuple):
        return None
    items = [_media_item(v) for v in value]
    return None if any(item is None for item in items) else items  # type: ignore[return-value]


def _media_cells(values: list[Any], depth: int) -> list[Any] | None:
    """Return a column's cells as image lists (``depth`` 1) or frame-list lists (2), or None."""
    out: list[Any] = []
    for value in values:
        if value is None:
            out.append(None)
            continue
        if depth == 1:
            cell = _image_list(value)
        elif isinstance(value, list | tuple):
            cell = [_image_list(clip) for clip in value]
            cell = None if any(clip is None for clip in cell) else cell
        else:
            cell = None
        if cell is None:
            return None
        out.append(cell)
    return out


def _has_binary(value: Any) -> bool:
    if isinstance(value, bytes | bytearray | memoryview) or _is_pil(value):
        return True
    if isinstance(value, Mapping):
        return any(_has_binary(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_has_binary(v) for v in value)
    return False


def _media_column(values: list[Any]) -> tuple[int, list[Any]] | None:
    """``(depth, cells)`` when a column holds images (with bytes) as verl stores them."""
    if not any(_has_binary(v) for v in values):
        return None  # image paths alone stay JSON, as files written before
    for depth in (1, 2):
        cells = _media_cells(values, depth)
        if cells is not None:
            return depth, cells
    return None


def _rows_to_table(rows: list[Mapping[str, Any]]) -> pa.Table:
    names = _column_names(rows)
    arrays: dict[str, pa.Array] = {}
    json_columns: list[str] = []
    media_columns: dict[str, dict[str, Any]] = {}
    for name in names:
        media = _media_column([row.get(name) for row in rows])
        if media is not None:
            depth, cells = media
            arrow_type = pa.list_(_MEDIA_STRUCT)
            if depth == 2:
                arrow_type = pa.list_(arrow_type)
            arrays[name] = pa.array(cells, type=arrow_type)
            # A null cell is a None value or a missing key: the rows lacking it are listed.
            missing = [i for i, row in enumerate(rows) if name not in row]
            media_columns[name] = {"depth": depth, "missing": missing}
            continue
        present = all(name in row for row in rows)
        values = [row.get(name) for row in rows]
        kind = _native_type(values) if present and rows else None
        if kind is not None:
            pa_type = {bool: pa.bool_(), int: pa.int64(), float: pa.float64(), str: pa.string()}
            try:
                arrays[name] = pa.array(values, type=pa_type[kind])
                continue
            except OverflowError:
                pass  # ints beyond int64 fall back to JSON, which keeps them exactly
        json_columns.append(name)
        cells = [
            json.dumps(_to_jsonable(row[name], f"row {i}: column {name!r}"), ensure_ascii=False)
            if name in row
            else None
            for i, row in enumerate(rows)
        ]
        arrays[name] = pa.array(cells, type=pa.string())
    metadata = {
        FORMAT_KEY: FORMAT_VERSION,
        JSON_COLUMNS_KEY: json.dumps(json_columns).encode(),
        MEDIA_COLUMNS_KEY: json.dumps(media_columns).encode(),
        NUM_ROWS_KEY: str(len(rows)).encode(),
    }
    schema = pa.schema([pa.field(n, arrays[n].type) for n in names], metadata=metadata)
    return pa.Table.from_arrays([arrays[n] for n in names], schema=schema)


def _strip_struct_nulls(value: Any, arrow_type: pa.DataType) -> Any:
    """Undo parquet's struct padding: drop None-valued keys of struct values, recursively."""
    if value is None:
        return None
    if pa.types.is_struct(arrow_type):
        out = {}
        for i in range(arrow_type.num_fields):
            field = arrow_type.field(i)
            v = value.get(field.name)
            if v is not None:
                out[field.name] = _strip_struct_nulls(v, field.type)
        return out
    if pa.types.is_map(arrow_type):
        return {k: _strip_struct_nulls(v, arrow_type.item_type) for k, v in value}
    if (
        pa.types.is_list(arrow_type)
        or pa.types.is_large_list(arrow_type)
        or pa.types.is_fixed_size_list(arrow_type)
    ):
        return [_strip_struct_nulls(v, arrow_type.value_type) for v in value]
    return value


def _table_to_rows(table: pa.Table, path: Path) -> list[dict[str, Any]]:
    metadata = table.schema.metadata or {}
    if JSON_COLUMNS_KEY in metadata:
        json_columns = set(json.loads(metadata[JSON_COLUMNS_KEY]))
        media_columns = json.loads(metadata.get(MEDIA_COLUMNS_KEY, b"{}"))
        columns = {name: table.column(name).to_pylist() for name in table.column_names}
        for name in media_columns:
            col_type = table.schema.field(name).type
            columns[name] = [_strip_struct_nulls(v, col_type) for v in columns[name]]
        missing = {name: set(m.get("missing", ())) for name, m in media_columns.items()}
        num_rows = int(metadata.get(NUM_ROWS_KEY, table.num_rows))
        if table.num_columns and num_rows != table.num_rows:
            raise ValueError(
                f"{path}: metadata says {num_rows} rows but the table has {table.num_rows}"
            )
        rows: list[dict[str, Any]] = []
        for i in range(num_rows):
            row: dict[str, Any] = {}
            for name, values in columns.items():
                cell = values[i]
                if name in json_columns:
                    if cell is None:
                        continue  # the row did not have this key
                    try:
                        row[name] = json.loads(cell)
                    except json.JSONDecodeError as err:
                        raise ValueError(
                            f"{path}: row {i} column {name!r} is not valid JSON: {err}"
                        ) from err
                elif name in missing and i in missing[name]:
                    continue  # the row did not have this media column
                else:
                    row[name] = cell
            rows.append(row)
        return rows

    # A foreign parquet file (pandas, pyarrow, verl preprocess scripts).
    drop: set[str] = set()
    if b"pandas" in metadata:
        try:
            pandas_meta = json.loads(metadata[b"pandas"])
            drop = {c for c in pandas_meta.get("index_columns", []) if isinstance(c, str)}
        except (json.JSONDecodeError, AttributeError):
            drop = set()
    names = [n for n in table.column_names if n not in drop]
    columns = {}
    for name in names:
        col = table.column(name)
        values = col.to_pylist()
        if pa.types.is_nested(col.type):
            values = [_strip_struct_nulls(v, col.type) for v in values]
        columns[name] = values
    return [{name: columns[name][i] for name in names} for i in range(table.num_rows)]


def read_rows(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read rows from a ``.parquet``, ``.jsonl`` or ``.json`` (a list of objects) file.

    Args:
        path: The file to read.

    Returns:
        The rows as plain Python dicts (lists, not numpy arrays, for list values).

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        ValueError: For an unknown suffix or malformed content, naming the line/row.
    """
    path = Path(path)
    suffix = _suffix(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {str(path)!r}")
    if suffix == ".parquet":
        return _table_to_rows(pq.read_table(path), path)
    if suffix == ".jsonl":
        rows = []
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{lineno}: invalid JSON: {err}") from err
                if not isinstance(row, dict):
                    raise ValueError(
                        f"{path}:{lineno}: expected a JSON object per line, "
                        f"got {type(row).__name__}"
                    )
                rows.append(row)
        return rows
    with path.open(encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: invalid JSON: {err}") from err
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of objects, got {type(data).__name__}")
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise ValueError(f"{path}: item {i} must be a JSON object, got {type(row).__name__}")
    return data


def write_rows(rows: Iterable[Mapping[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Write rows atomically (temp file + rename) as parquet, JSON Lines or a JSON list.

    The format follows the suffix of ``path``; parent folders are created.  Nested and
    free-form values survive :func:`read_rows` unchanged (tuples come back as lists and numpy
    values as Python values).

    Args:
        rows: The rows, each a dict with string keys.
        path: Destination file ending in ``.parquet``, ``.jsonl`` or ``.json``.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ValueError: For an unknown suffix.
        TypeError: For a row that is not a dict or holds a value that cannot be stored.
    """
    path = Path(path)
    suffix = _suffix(path)
    rows = _check_rows(rows)

    if suffix == ".parquet":
        table = _rows_to_table(rows)
        _atomic_write(path, lambda tmp: pq.write_table(table, tmp))
        return path

    payload = [_to_jsonable(dict(row), f"row {i}") for i, row in enumerate(rows)]
    if suffix == ".jsonl":
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in payload)
    else:
        text = json.dumps(payload, ensure_ascii=False, indent=1) + "\n"
    _atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return path
