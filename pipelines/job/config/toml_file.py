"""The job config's TOML file (``freescale train --config job.toml``): a table per section of
pipelines.job.config.JobConfig, each key a field of its section.

Every value is checked against its field's type by the config's one type check (config.type_problem); each error
is one line naming the file and the line, or the table and key.
"""

from __future__ import annotations

import difflib
import tomllib
from pathlib import Path
from typing import Any

from pipelines.job.config.sections import SECTIONS, TABLES, config_fields, field_kind, shown, type_problem


def _load_tables(path: Path) -> dict[str, Any]:
    """The TOML file's top level; one-line errors for a missing file, bad TOML, keys outside any table, unknown
    tables and tables that are not tables."""
    if not path.is_file():
        raise ValueError(f"config file {path} does not exist")
    try:
        with path.open("rb") as fh:
            tables = tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:  # its text gives the line and column
        raise ValueError(f"{path}: not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: not UTF-8 text (byte {exc.start})") from None
    for name, value in tables.items():
        homes = _homes(name)
        if homes and name not in SECTIONS:
            raise ValueError(f"{path}: {name} = {shown(value)} is outside any table; it belongs in {homes}")
    unknown = set(tables) - set(SECTIONS)
    for table in sorted(unknown):  # a key of a table that is gone, which now belongs in another (a knob's owner)
        keys = tables[table] if isinstance(tables[table], dict) else {}
        moved = next((key for key in keys if _homes(key)), None)
        if moved is not None:
            raise ValueError(f"{path}: [{table}] has unknown key {moved!r} (it belongs in {_homes(moved)})")
    if unknown:
        raise ValueError(f"{path}: unknown table(s) {sorted(unknown)}; expected {', '.join(TABLES)}")
    for table, keys in tables.items():
        if not isinstance(keys, dict):
            raise ValueError(
                f"{path}: {table}: expected a table ([{table}]), got {shown(keys)} ({type(keys).__name__})"
            )
    return tables


def _homes(key: str) -> str:
    """Where a key belongs: ``[process]``, ``[run] or [embeddings]``; "" if nowhere."""
    return " or ".join(f"[{path.split('.')[0]}]" for path in config_fields() if path.split(".")[1] == key)


def _closest(table: str, key: str) -> str:
    """The known key of ``table`` a user most likely meant, as a hint: a flag's negation (``no_progress``, since the
    TOML keys are the flags' names) as the field set to false, else the nearest spelling; "" if none is near."""
    fields = config_fields()
    spelled = key.replace("-", "_")
    negated = f"{table}.{spelled.removeprefix('no_')}"
    if spelled.startswith("no_") and negated in fields and field_kind(negated) is bool:
        return f"; write {negated.split('.')[1]} = false"
    keys = [p.split(".")[1] for p in fields if p.split(".")[0] == table]
    match = difflib.get_close_matches(spelled, keys, n=1)
    return f"; did you mean {match[0]}?" if match else ""


def read_toml(path: Path) -> dict[str, Any]:
    """path (``run.steps``) -> value, from the TOML file ``path``: a table per section, every key a field of its
    table, every value of its field's type; each error names the file (and the line, the table, the key)."""
    fields = config_fields()
    tables = _load_tables(path)
    values = {}
    for table, keys in tables.items():
        for key, value in keys.items():
            known = f"{table}.{key}"
            if known not in fields:
                where = f" (it belongs in {_homes(key)})" if _homes(key) else _closest(table, key)
                raise ValueError(f"{path}: [{table}] has unknown key {key!r}{where}")
            problem = type_problem(field_kind(known), value)
            if problem:
                raise ValueError(f"{path}: [{table}] {key}: {problem}")
            values[known] = float(value) if field_kind(known) is float else value
    return values
