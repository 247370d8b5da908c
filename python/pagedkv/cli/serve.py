"""``pagedkv serve``: the server's flags and handler, and the parsing helpers ``router`` shares.

Owns the flags generated from :class:`~pagedkv.engine.config.EngineConfig`'s fields
(:func:`serve_engine_fields`, :func:`serve_flags_markdown` for docs/serve.md), ``--config`` YAML
files, and secrets (``--api-key``, ``--hash-seed``, secret engine fields: flag, ``--x-file`` or
environment). The server itself lives in :mod:`pagedkv.serve`.

Invariants: a secret given on the command line draws one warning line on stderr; an error about a
secret names where it came from, never its value; flags on the command line override the
``--config`` file's.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any, Dict, Optional, Sequence

from ..config import parse_bytes
from ..errors import InvalidConfigError
from ._args import UsageError, _float, _nonneg_int, _Parser, _positive_float, _positive_int, _size


def _require_serve(purpose: str) -> None:
    """Before loading anything: the server's dependencies, naming the extra that installs them."""
    import importlib.util

    from .._optional import missing

    for module in ("fastapi", "uvicorn", "pydantic", "prometheus_client", "httpx"):
        if importlib.util.find_spec(module) is None:
            raise missing(module, purpose, extra="serve")


#: Older names of generated serve flags that turn a default-on knob off (kept working).
_SERVE_NEGATIVE_ALIASES = {
    "enable_prefix_caching": ("--no-prefix-caching",),
    "enable_chunked_prefill": ("--no-chunked-prefill",),
}
#: The help group a generated flag goes in, by the field name's prefix (else "engine").
_SERVE_FIELD_GROUPS = (
    (("host_cache_", "disk_cache_", "remote_cache_"), "tiers of the prefix cache (docs/tiers.md)"),
    (("kv_events_",), "KV events (docs/kv-events.md)"),
)
#: vLLM's names for KV-cache dtypes, and the torch names they stand for.
_DTYPE_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16",
                "float16": "float16", "half": "float16", "fp32": "float32", "float32": "float32",
                "float": "float32"}


class _Toggle(argparse.Action):
    """A boolean flag and its negations: ``--x`` sets True; ``--no-x`` (and older aliases) False."""

    def __init__(self, option_strings: Sequence[str], dest: str,
                 negatives: Sequence[str] = (), **kwargs: Any) -> None:
        self.negatives = frozenset(negatives)
        super().__init__([*option_strings, *negatives], dest, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: Optional[str] = None) -> None:
        setattr(namespace, self.dest, option_string not in self.negatives)

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)


def _int_any_base(text: str) -> int:
    """An argparse type: an integer, decimal or ``0x...``."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def serve_engine_fields() -> list[tuple[Any, str]]:
    """The :class:`~pagedkv.engine.config.EngineConfig` fields ``pagedkv serve`` takes as flags,
    each with its kind: ``bool``, ``int``, ``float``, ``size`` (bytes or ``"4GiB"``) or ``str``
    (also any other type: the flag's text goes to the config as it is, which validates it; a
    field the command line cannot express has ``metadata={"cli": False}``)."""
    import dataclasses
    import types
    import typing

    from ..engine.config import EngineConfig

    hints = typing.get_type_hints(EngineConfig)
    out = []
    for f in dataclasses.fields(EngineConfig):
        if not f.metadata.get("cli", True):
            continue
        tp = hints[f.name]
        args = set(typing.get_args(tp)) - {type(None)} if typing.get_origin(tp) in (
            typing.Union, types.UnionType) else {tp}
        if args == {bool}:
            kind = "bool"
        elif args == {int}:
            kind = "int"
        elif args == {float}:
            kind = "float"
        elif args == {int, str}:
            kind = "size"
        else:  # a string, or a type with no command-line form: the text, for the config to check
            kind = "str"
        out.append((f, kind))
    return out


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _default_text(f: Any, kind: str) -> Optional[str]:
    if f.default is None:
        return None
    if kind == "bool":
        return "on" if f.default else "off"
    if f.default == "":
        return "empty"
    return str(f.default)


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    """One flag per :func:`serve_engine_fields` field; default None (the field's own default)."""
    groups: dict[str, Any] = {}
    fields = serve_engine_fields()
    names = {f.name for f, _kind in fields}
    for f, kind in fields:
        title = next((t for prefixes, t in _SERVE_FIELD_GROUPS if f.name.startswith(prefixes)),
                     "engine")
        if title not in groups:
            groups[title] = p.add_argument_group(title)
        g = groups[title]
        help_text = str(f.metadata.get("help", f"EngineConfig.{f.name}"))
        default = _default_text(f, kind)
        if default is not None and "default:" not in help_text:
            help_text += f" (default: {default})"
        env = f.metadata.get("secret_env")
        if env:
            help_text += f"; a secret: prefer ${env}" + (
                f" or {_flag(f.name)}-file" if f.metadata.get("secret_file") else "")
        # Field names in the help read as the flags they are here: num_blocks -> --num-blocks.
        help_text = re.sub(r"\b[a-z]+(?:_[a-z0-9]+)+\b",
                           lambda m: _flag(m[0]) if m[0] in names else m[0], help_text)
        help_text = help_text.replace("%", "%%")
        name = _flag(f.name)
        if kind == "bool":
            negatives = ("--no-" + name[2:], *_SERVE_NEGATIVE_ALIASES.get(f.name, ()))
            g.add_argument(name, dest=f.name, action=_Toggle, negatives=negatives, default=None,
                           help=help_text)
            continue
        kw: dict[str, Any] = {"dest": f.name, "default": None, "help": help_text}
        if "choices" in f.metadata:
            kw["choices"] = tuple(f.metadata["choices"])
        elif kind == "int":
            kw.update(type=_int_any_base, metavar="KEY" if env else "N")
        elif kind == "float":
            kw.update(type=_float, metavar="X")
        elif kind == "size":
            kw.update(type=_size, metavar="SIZE")
        else:
            kw["metavar"] = f.name.rpartition("_")[2].upper()
        g.add_argument(name, **kw)
        if f.metadata.get("secret_file"):
            g.add_argument(name + "-file", dest=f.name + "_file", metavar="FILE", default=None,
                           help=f"read {name}'s value from FILE (keeps it off the command line)")


#: Flags whose value is a secret (serve and router; a serve engine flag is one when its field
#: has ``metadata["secret_env"]``): on the command line, they draw a warning.
_SECRET_FLAGS = ("--api-key", "--hash-seed", "--remote-cache-url")


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_path", nargs="?", metavar="MODEL", default=None,
                   help="a Hugging Face model directory or a .gguf file (default: the embedded "
                        "SmolLM2-135M-Instruct GGUF)")
    g = p.add_argument_group("server")
    g.add_argument("--config", metavar="FILE", default=None,
                   help="a YAML file of flags (keys: flag names, - or _); flags on the command "
                        "line override it")
    g.add_argument("--model", dest="model_opt", metavar="MODEL", default=None,
                   help="the model, as an option instead of the positional MODEL")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default: 127.0.0.1, loopback only; 0.0.0.0 exposes it)")
    g.add_argument("--port", type=_nonneg_int, default=8000,
                   help="port, bound before the model loads (default: 8000)")
    g.add_argument("--served-model-name", metavar="NAME", default=None,
                   help="the model's name in the API (default: the model's directory or file "
                        "name; SmolLM2-135M-Instruct for the embedded model)")
    g.add_argument("--api-key", metavar="KEY", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: "
                        "$PAGEDKV_API_KEY, else $VLLM_API_KEY, else none); a secret: prefer the "
                        "environment or --api-key-file")
    g.add_argument("--api-key-file", metavar="FILE", default=None,
                   help="read --api-key's value from FILE (keeps it off the command line)")
    g.add_argument("--max-queue-size", type=_positive_int, default=None, metavar="N",
                   help="refuse a request with 503 while N requests wait for their first token "
                        "(default: no limit)")
    g.add_argument("--chat-template", metavar="FILE|TEMPLATE", default=None,
                   help="a Jinja chat template (a file or the template itself) instead of the "
                        "tokenizer's")
    g.add_argument("--log-level", "--uvicorn-log-level", dest="log_level", default="info",
                   choices=("critical", "error", "warning", "info", "debug", "trace"),
                   help="uvicorn's log level (default: info)")
    g = p.add_argument_group("limits on what a client controls (docs/serve.md)")
    g.add_argument("--max-logprobs", type=_nonneg_int, default=None, metavar="N",
                   help="most logprobs / top_logprobs a request may ask for; above it a 400 "
                        "(default: 20, as vLLM)")
    g.add_argument("--max-prompt-bytes", type=_positive_int, default=None, metavar="N",
                   help="refuse a text prompt of more bytes before tokenizing it (default: "
                        "derived from the model's context)")
    g.add_argument("--max-connections", type=_positive_int, default=None, metavar="N",
                   help="open connections at most; above it a 503 and close (default: 1024, "
                        "lowered to the open-file limit)")
    g.add_argument("--header-timeout", type=_positive_float, default=None, metavar="S",
                   help="seconds a client has to send a request's headers (default: 10)")
    g.add_argument("--body-timeout", type=_positive_float, default=None, metavar="S",
                   help="seconds a client has to send a request's body (default: 30)")
    g.add_argument("--timeout-keep-alive", "--keep-alive-timeout", dest="keep_alive",
                   type=_positive_int, default=None, metavar="S",
                   help="seconds an idle keep-alive connection stays open (default: 5)")
    g = p.add_argument_group("model")
    g.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    g.add_argument("--dtype", default=None,
                   help="weights and KV dtype (default: float32 on the CPU, the checkpoint's on a GPU)")
    g.add_argument("--kv-cache-dtype", default="auto", metavar="DTYPE",
                   help="KV cache dtype: auto, the model's dtype (the only one pagedkv keeps the "
                        "cache in; --dtype's value is accepted too) (default: auto)")
    g.add_argument("--max-model-len", type=_positive_int, default=None, metavar="N",
                   help="longest sequence (prompt and output), at most the model's context "
                        "(default: the model's context, or what the pool holds if less)")
    g.add_argument("--tokenizer", metavar="DIR|FILE", default=None,
                   help="load the tokenizer from here instead of the model's directory")
    _add_engine_flags(p)
    _wrap_parse(p, config=True)


def _wrap_parse(p: argparse.ArgumentParser, *, config: bool) -> None:
    """Wraps ``p``'s parsing: with ``config``, ``--config FILE`` reads as the file's flags placed
    before the command line's (which win); and the namespace records which secret flags were
    given on the command line (``argv_secrets``), to warn about them."""
    parse = p.parse_known_args

    def parse_known_args(args: Optional[Sequence[str]] = None,
                         namespace: Optional[argparse.Namespace] = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        given = list(sys.argv[1:] if args is None else args)
        path = _config_path(p, given) if config else None
        from_file = [] if path is None else _config_argv(p, path)
        ns, extras = parse(from_file + given, namespace)
        secret = [*_SECRET_FLAGS, *(_flag(f.name) for f, _k in serve_engine_fields()
                                    if f.metadata.get("secret_env"))] if config else _SECRET_FLAGS
        ns.argv_secrets = _given_flags(p, given, secret)
        ns.model_from_file = "--model" in from_file
        return ns, extras

    p.parse_known_args = parse_known_args  # type: ignore[method-assign]


def _given_flags(p: argparse.ArgumentParser, argv: Sequence[str], flags: Sequence[str]
                 ) -> list[str]:
    """Which of ``flags`` ``argv`` gives, spelled out or abbreviated as argparse accepts."""
    options = p._option_string_actions
    found = set()
    for a in argv:
        if not a.startswith("--"):
            continue
        token = a.partition("=")[0]
        matches = [token] if token in options else [o for o in options if o.startswith(token)]
        if len(matches) == 1 and matches[0] in flags:
            found.add(matches[0])
    return sorted(found)


def serve_flags_markdown() -> str:
    """The flag tables of ``docs/serve.md`` (one per help group), from the parser itself: the
    docs show what ``pagedkv serve --help`` does, and a test keeps them equal."""
    p = _Parser(prog="pagedkv serve")
    _add_serve_args(p)
    out: list[str] = []
    for group in p._action_groups:
        rows = []
        for a in group._group_actions:
            if a.help == argparse.SUPPRESS or isinstance(a, argparse._HelpAction):
                continue
            if not a.option_strings:
                names = f"`{a.metavar}`"
            elif a.nargs == 0:
                names = " / ".join(f"`{o}`" for o in a.option_strings)
            else:
                value = "\\|".join(map(str, a.choices)) if a.choices else str(a.metavar or
                                                                             a.dest.upper())
                first, *aliases = a.option_strings
                value = value.replace("|", "\\|") if not a.choices else value
                names = " / ".join([f"`{first} {value}`", *(f"`{o}`" for o in aliases)])
            text = str(a.help).replace("%%", "%").replace("|", "\\|")
            rows.append(f"| {names} | {text} |")
        if rows:
            out += [f"**{group.title}**", "", "| option | meaning |", "| --- | --- |", *rows, ""]
    return "\n".join(out).rstrip() + "\n"


def _config_path(p: argparse.ArgumentParser, argv: Sequence[str]) -> Optional[str]:
    path = None
    for i, a in enumerate(argv):
        if a == "--config":
            if i + 1 >= len(argv):
                p.error("argument --config: expected one argument")
            path = argv[i + 1]
        elif a.startswith("--config="):
            path = a.partition("=")[2]
    return path


def _config_argv(p: argparse.ArgumentParser, path: str) -> list[str]:
    """The flags a ``--config`` YAML file stands for (vLLM's format: a mapping of flag names,
    with - or _, to values; ``true`` / ``false`` for switches, a list for a repeated flag)."""
    try:
        import yaml
    except ImportError:
        from .._optional import missing

        p.error(str(missing("yaml", "--config")))
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except OSError as exc:
        p.error(f"--config {path}: {exc.strerror or exc}")
    except yaml.YAMLError as exc:
        p.error(f"--config {path}: not valid YAML: {' '.join(str(exc).split())}")
    if data is None:
        return []
    if not isinstance(data, dict):
        p.error(f"--config {path}: expected a mapping of flag names to values, got "
                f"{type(data).__name__}")
    actions = p._option_string_actions
    out: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        action = actions.get(flag)
        if action is None or flag in ("--config", "--help"):
            p.error(f"--config {path}: unknown key {key!r} (keys are `pagedkv serve` flags, "
                    f"e.g. max-num-seqs)")
        if value is None:
            continue
        if isinstance(action, _Toggle):
            if not isinstance(value, bool):
                p.error(f"--config {path}: {key} takes true or false, got {value!r}")
            # `x: false` is --no-x, and `no-x: false` is --x.
            negative = flag in action.negatives
            opposite = [s for s in action.option_strings if (s in action.negatives) != negative]
            out.append(flag if value else opposite[0])
        elif action.nargs == 0:  # store_true
            if not isinstance(value, bool):
                p.error(f"--config {path}: {key} takes true or false, got {value!r}")
            if value:
                out.append(flag)
        elif isinstance(value, list):
            if not isinstance(action, argparse._AppendAction):
                p.error(f"--config {path}: {key} takes one value, got a list")
            for v in value:
                out += [flag, str(v)]
        elif isinstance(value, dict):
            p.error(f"--config {path}: {key} takes a value, got a mapping")
        else:
            out += [flag, str(value).lower() if isinstance(value, bool) else str(value)]
    return out


def _warn_argv_secret(name: str, instead: str, prog: str) -> None:
    print(f"{prog}: warning: {name} on the command line is readable by other local users "
          f"(/proc/PID/cmdline); use {instead}", file=sys.stderr)


def _secret(name: str, given: Optional[str], file: Optional[str], envs: Sequence[str],
            argv_secrets: Sequence[str], prog: str) -> Optional[str]:
    """A secret from (in order) its flag, its file, or the first set environment variable; warns
    (one line on stderr) when the flag was given on the command line, where any local user can
    read it (/proc/PID/cmdline)."""
    import os

    if given is not None and file is not None:
        raise UsageError(f"give {name} or {name}-file, not both")
    if given is not None:
        if name in argv_secrets:
            _warn_argv_secret(name, " or ".join([f"${e}" for e in envs] + [f"{name}-file"]), prog)
        return given
    if file is not None:
        try:
            with open(file, encoding="utf-8") as fh:
                value = fh.read().strip()
        except OSError as exc:
            raise UsageError(f"{name}-file {file}: {exc.strerror or exc}") from None
        if not value:
            raise UsageError(f"{name}-file {file}: empty")
        return value
    for env in envs:
        value = os.environ.get(env, "").strip()
        if value:
            return value
    return None


def _hash_seed_value(args: argparse.Namespace, prog: str) -> Optional[int]:
    """``--hash-seed``, else ``--hash-seed-file``, else ``$PAGEDKV_HASH_SEED``, as an int."""
    if args.hash_seed is not None:
        if args.hash_seed_file is not None:
            raise UsageError("give --hash-seed or --hash-seed-file, not both")
        if "--hash-seed" in args.argv_secrets:
            _warn_argv_secret("--hash-seed", "$PAGEDKV_HASH_SEED or --hash-seed-file", prog)
        return int(args.hash_seed)
    text = _secret("--hash-seed", None, args.hash_seed_file, ("PAGEDKV_HASH_SEED",), (), prog)
    if text is None:
        return None
    try:
        return _hash_seed(text)
    except argparse.ArgumentTypeError:
        # Not echoed: the value is a secret.
        source = "--hash-seed-file" if args.hash_seed_file is not None else "$PAGEDKV_HASH_SEED"
        raise UsageError(f"{source}: the hash seed is not an integer in [0, 2**64)") from None


def _serve_engine_config(args: argparse.Namespace) -> Any:
    """The :class:`~pagedkv.engine.config.EngineConfig` of the generated flags (a flag not given
    keeps the field's default). A secret field (``metadata["secret_env"]``) not given as a flag
    comes from its ``--x-file`` (with ``metadata["secret_file"]``), else its environment
    variable; given as a flag on the command line, it draws a warning (a URL only when it holds a
    password)."""
    from ..engine.config import EngineConfig

    prog = "pagedkv serve"
    values = {}
    for f, kind in serve_engine_fields():
        value = getattr(args, f.name, None)
        env = f.metadata.get("secret_env")
        if env:
            flag = _flag(f.name)
            file = getattr(args, f.name + "_file", None)
            if value is not None:
                if file is not None:
                    raise UsageError(f"give {flag} or {flag}-file, not both")
                if flag in args.argv_secrets and not (
                        isinstance(value, str) and "://" in value and not _has_password(value)):
                    instead = f"${env}" + (f" or {flag}-file" if f.metadata.get("secret_file")
                                           else "")
                    _warn_argv_secret(flag, instead, prog)
            else:
                text = _secret(flag, None, file, (env,), (), prog)
                if text is not None:
                    value = _secret_value(text, kind, flag if file is None else flag + "-file",
                                          env if file is None else None)
        if value is not None:
            values[f.name] = value
    return EngineConfig(**values)


def _secret_value(text: str, kind: str, flag: str, env: Optional[str]) -> Any:
    """A secret read from a file or the environment, converted as its flag's type would (an
    error names where it came from, never the value)."""
    source = f"${env}" if env else flag
    try:
        if kind == "int":
            return int(text, 0)
        if kind == "float":
            return float(text)
        if kind == "size":
            return parse_bytes(text)
    except (ValueError, InvalidConfigError):
        raise UsageError(f"{source}: not {'an integer' if kind == 'int' else 'a ' + kind}") \
            from None
    return text


def _has_password(url: str) -> bool:
    from urllib.parse import urlsplit

    try:
        return urlsplit(url).password is not None
    except ValueError:
        return "@" in url


def _hash_seed(text: str) -> int:
    try:
        value = int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= value < 1 << 64:
        raise argparse.ArgumentTypeError(f"{text} is outside [0, 2**64)")
    return value


def _check_kv_cache_dtype(kv_dtype: str, dtype: Optional[str]) -> None:
    """vLLM's ``--kv-cache-dtype``: the engine keeps the KV cache in the model's dtype, so ``auto``
    (or ``--dtype``'s own value) is accepted and anything else is refused before loading."""
    if kv_dtype == "auto":
        return
    name = _DTYPE_NAMES.get(kv_dtype.lower().removeprefix("torch."))
    if name is not None and dtype is not None and \
            name == _DTYPE_NAMES.get(dtype.lower().removeprefix("torch.")):
        return
    raise UsageError(f"--kv-cache-dtype {kv_dtype}: pagedkv keeps the KV cache in the model's "
                     f"dtype (--dtype{' ' + dtype if dtype else ''}); give auto"
                     + (" or --dtype's value" if dtype else ""))


def _run_serve(args: argparse.Namespace) -> int:
    import os

    _require_serve("pagedkv serve")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see demo._run_demo
    model = args.model_path or args.model_opt
    if args.model_path is not None and args.model_opt is not None:
        if not getattr(args, "model_from_file", False):
            raise UsageError("give the model once: MODEL or --model")
        model = args.model_path  # the command line's wins over the --config file's
    prog = "pagedkv serve"
    argv_secrets = getattr(args, "argv_secrets", ())
    args.argv_secrets = argv_secrets
    api_key = _secret("--api-key", args.api_key, args.api_key_file,
                      ("PAGEDKV_API_KEY", "VLLM_API_KEY"), argv_secrets, prog)
    config = _serve_engine_config(args)
    _check_kv_cache_dtype(args.kv_cache_dtype, args.dtype)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(name)s: %(message)s")
    from ..serve.app import serve

    serve(model, host=args.host, port=args.port,
          served_model_name=args.served_model_name, max_queue_size=args.max_queue_size,
          api_key=api_key, chat_template=args.chat_template, log_level=args.log_level,
          engine_config=config, device=args.device, dtype=args.dtype,
          max_model_len=args.max_model_len, tokenizer=args.tokenizer, **_serve_limits(args))
    return 0


def _serve_limits(args: argparse.Namespace) -> Dict[str, Any]:
    """The client-facing limits given on the command line, by :func:`serve`'s keyword (the rest
    keep serve's defaults)."""
    names = {"max_logprobs": "max_logprobs", "max_prompt_bytes": "max_prompt_bytes",
             "max_connections": "max_connections", "header_timeout": "header_timeout_s",
             "body_timeout": "body_timeout_s", "keep_alive": "keep_alive_s"}
    return {kw: getattr(args, dest) for dest, kw in names.items()
            if getattr(args, dest) is not None}
