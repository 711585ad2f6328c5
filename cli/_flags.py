"""The flags of ``tensordepot serve``, made from the broker's ``Settings``.

Each field becomes one flag: ``max_memory`` is ``--max-memory``, read also
from ``$TENSORDEPOT_MAX_MEMORY``, and its help is the field's description,
so a setting is described in one place (service/config.py).  The type of
the field picks the flag's kind: a list is repeatable, a bool is a switch,
an int or a float is checked by argparse.  Flags default to None: a flag
left out lets the environment, then the field's default, decide.
"""

from __future__ import annotations

import argparse
import functools
import typing
from typing import Any

from pydantic.fields import FieldInfo

from .._defaults import ENV_PREFIX

# Placeholders in the help: S for every float (seconds), N for every int, these
# for the rest (a setting missing here shows its name, as MAX_MEMORY).
METAVARS = {
    "listen": "URL",
    "max_memory": "SIZE",
    "segment_size": "SIZE",
    "warm_memory": "SIZE",
    "prealloc": "SIZE",
    "cuda_memory": "SIZE",
    "cuda_segment_size": "SIZE",
    "shm_prefix": "PREFIX",
    "shm_group": "GROUP",
    "token": "TOKEN",
    "token_file": "PATH",
    "allow_uid": "UID",
    "allow_gid": "GID",
    "max_memory_per_session": "SIZE",
    "max_memory_per_token": "SIZE",
    "log_level": "LEVEL",
    "flight": "URL",
    "flight_tls_cert": "PEM",
    "flight_tls_key": "PEM",
    "peer": "URL",
    "peer_token": "TOKEN",
    "peer_tls_ca": "PEM",
}
_NUMBER_METAVARS: dict[Any, str] = {float: "S", int: "N"}
HOSTS = ("flight", "peer")  # settings named <this> or <this>_*: the "across hosts" group
HOSTS_TITLE = "across hosts (Arrow Flight; pip install 'tensordepot[flight]')"


def flag(name: str) -> str:
    """``max_memory`` -> ``--max-memory``."""
    return "--" + name.replace("_", "-")


def env_var(name: str) -> str:
    """``max_memory`` -> ``TENSORDEPOT_MAX_MEMORY``."""
    return ENV_PREFIX + name.upper()


def where(name: str) -> str:
    """How messages name a setting: ``--max-memory (or $TENSORDEPOT_MAX_MEMORY)``."""
    return f"{flag(name)} (or ${env_var(name)})"


def _kind(field: FieldInfo) -> dict[str, Any]:
    annotation = field.annotation
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) is list:
        return {"action": "append"}
    if annotation is bool:
        return {"action": "store_true", "default": None}
    if annotation in (int, float):
        return {"type": annotation}
    return {}


def add_settings(parser: argparse.ArgumentParser, fields: dict[str, FieldInfo]) -> None:
    """One flag per field, in field order; the Flight and peer settings in a group."""
    hosts = parser.add_argument_group(HOSTS_TITLE)
    for name, field in fields.items():
        where_to = hosts if name.split("_")[0] in HOSTS else parser
        kw: dict[str, Any] = {"dest": name, "help": field.description, **_kind(field)}
        if "action" not in kw or kw["action"] == "append":
            kw["metavar"] = _NUMBER_METAVARS.get(kw.get("type")) or METAVARS.get(name, name.upper())
        where_to.add_argument(flag(name), **kw)


class SettingsHelp(argparse.HelpFormatter):
    """Shows each setting's variable and default after its help, when
    ``--help`` prints it (the help itself stays the field's description)."""

    def __init__(self, prog: str, *, fields: dict[str, FieldInfo], **kw: Any) -> None:
        super().__init__(prog, **kw)
        self._fields = fields

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        field = self._fields.get(action.dest)
        if text is None or field is None:
            return text
        notes = [
            f"${env_var(action.dest)}"
            + (", comma separated" if _kind(field).get("action") == "append" else "")
        ]
        default = field.get_default(call_default_factory=False)
        if (
            isinstance(default, (int, float, str))
            and not isinstance(default, bool)
            and default != ""
        ):
            notes.append(f"default {default}")
        # argparse expands %-format in help: a literal % must be doubled.
        return f"{text} [{'; '.join(notes)}]".replace("%", "%%")


def formatter(fields: dict[str, FieldInfo]) -> Any:
    """A ``formatter_class`` for the parser of ``fields``."""
    return functools.partial(SettingsHelp, fields=fields)
