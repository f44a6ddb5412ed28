"""The ``polyrl`` command line.

Subcommands are registered with :func:`subcommand`; a later command (``train``, ``serve``...)
is one decorated setup function in this module::

    @subcommand("train", help="Train a policy with RL.")
    def _train(parser: argparse.ArgumentParser) -> Handler:
        add_config_arguments(parser)

        def run(args: argparse.Namespace) -> int:
            cfg = config_from_args(args)
            from polyrl.trainer import train  # heavy imports inside the handler keep --help fast
            train(cfg)
            return 0

        return run

User errors (:class:`CLIError`, :class:`~polyrl.config.ConfigError`, and what a command maps to
them: bad data rows, a reward function that cannot be loaded or fails on too many samples)
print one line on stderr and exit with code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import NoReturn

import yaml

from polyrl.config import (
    ConfigError,
    ConfigNote,
    ConfigProblems,
    PolyRLConfig,
    available_presets,
    describe,
    load_config,
    to_yaml,
)
from polyrl.config.loader import inline_yaml, verl_config_overrides
from polyrl.core.registry import Registry

__all__ = [
    "CLIError",
    "Handler",
    "add_config_arguments",
    "build_parser",
    "config_from_args",
    "main",
    "subcommand",
]

Handler = Callable[[argparse.Namespace], "int | None"]
"""Runs a parsed command; returns the exit code (``None`` means 0)."""

Setup = Callable[[argparse.ArgumentParser], "Handler | None"]
"""Adds a command's arguments; returns its handler, or ``None`` when it sets ``handler`` on its
own nested subparsers (``parser.set_defaults(handler=...)``)."""

USAGE_ERROR = 2


class CLIError(Exception):
    """A user error on the command line: printed as one line, exit code 2."""


@dataclasses.dataclass(frozen=True)
class _Command:
    name: str
    help: str
    setup: Setup


_COMMANDS: Registry[_Command] = Registry("polyrl subcommand")


def subcommand(name: str, help: str) -> Callable[[Setup], Setup]:
    """Register a top-level ``polyrl NAME`` command.

    The decorated function receives the command's ``argparse`` parser, adds its arguments and
    returns the handler to run (see the module docstring).

    Raises:
        ValueError: when ``name`` is already registered.
    """

    def register(setup: Setup) -> Setup:
        _COMMANDS.add(name, _Command(name, help, setup))
        return setup

    return register


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors become :class:`CLIError` (one line, no usage dump)."""

    intermixed = False
    """Read options anywhere among the positionals (``train grpo --config-path D k=v``)."""
    _parsing = False

    def error(self, message: str) -> NoReturn:
        raise CLIError(f"{message} (see '{self.prog} --help')")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[no-untyped-def]
        # A subcommand's parser is called through parse_known_args; the intermixed parse
        # calls it again, hence the guard.
        if not self.intermixed or self._parsing:
            return super().parse_known_args(args, namespace)
        self._parsing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._parsing = False


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("polyrl")
    except Exception:  # an uninstalled checkout still answers --version
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    """Build the ``polyrl`` parser with every registered subcommand."""
    parser = _Parser(
        prog="polyrl",
        description="polyrl: composable RL post-training for large language models.",
    )
    parser.add_argument("--version", action="version", version=f"polyrl {_version()}")
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the traceback of a run that stopped on a failure (see RunAbortedError)",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for _, cmd in _COMMANDS.items():
        sub = commands.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        handler = cmd.setup(sub)
        if handler is not None:
            sub.set_defaults(handler=handler)
    return parser


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``[PRESET] [key=value ...]`` arguments shared by commands that load a config."""
    names = ", ".join(available_presets())
    parser.add_argument(
        "preset",
        nargs="?",
        metavar="PRESET",
        help=f"a bundled preset ({names}) or a YAML file; default: default",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="overrides such as trainer.total_steps=10 data.train_files=[a.parquet,b.parquet]",
    )
    # verl's (Hydra's) options: a YAML config in verl's keys, read before the overrides.
    parser.add_argument(
        "--config-path",
        "-cp",
        metavar="DIR",
        help="verl's --config-path: the folder of --config-name (default: the current one)",
    )
    parser.add_argument(
        "--config-name",
        "-cn",
        metavar="NAME",
        help="verl's --config-name: DIR/NAME.yaml, a config in verl's keys (its defaults: may "
        "name ppo_trainer; hydra: is ignored), read before the key=value overrides",
    )
    if isinstance(parser, _Parser):
        parser.intermixed = True


def config_from_args(args: argparse.Namespace) -> PolyRLConfig:
    """Load the config named by the arguments from :func:`add_config_arguments`.

    The first argument is the preset when it has no ``=`` (or names a ``.yaml`` file);
    otherwise it is the first override.
    """
    preset: str | None = args.preset
    overrides: list[str] = list(args.overrides)
    if preset is not None and "=" in preset and not preset.endswith((".yaml", ".yml")):
        overrides.insert(0, preset)
        preset = None
    config_path, config_name = (
        getattr(args, "config_path", None),
        getattr(args, "config_name", None),
    )
    if config_path is not None and config_name is None:
        raise CLIError("--config-path needs --config-name (the YAML file in that folder)")
    base: list[str] = []
    with warnings.catch_warnings(record=True) as notes:
        warnings.simplefilter("always", ConfigNote)
        if config_name is not None:
            base, base_notes = verl_config_overrides(config_path, config_name)
            overrides = base + overrides  # the command line wins, as in verl
            for note in base_notes:
                warnings.warn(note, ConfigNote, stacklevel=1)
        try:
            cfg = load_config(preset, overrides)
        except ConfigError as exc:
            if exc.source not in {f"override '{text}'" for text in base}:
                raise
            # The key came from the YAML, not from the line the user sees: say so.
            where = f"{exc.source}, read from --config-name {config_name}"
            raise ConfigError(exc.detail, key=exc.key, source=where) from None
    for note in notes:
        if issubclass(note.category, ConfigNote):
            print(f"polyrl: note: {note.message}", file=sys.stderr)
        else:
            warnings.showwarning(note.message, note.category, note.filename, note.lineno)
    return cfg


@subcommand("config", help="Show or describe the configuration.")
def _config_command(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="config_command", metavar="ACTION", required=True)

    show = actions.add_parser(
        "show",
        help="Print the merged config as YAML.",
        description="Print the config built from a preset and overrides, as YAML.",
    )
    add_config_arguments(show)
    show.set_defaults(handler=_config_show)

    desc = actions.add_parser(
        "describe",
        help="List every option with its type, default and description.",
        description="List every option with its type, default and description.",
    )
    desc.add_argument(
        "--format",
        choices=("text", "markdown"),
        default="text",
        help="text (default) or a markdown table for docs",
    )
    desc.set_defaults(handler=_config_describe)

    presets = actions.add_parser("presets", help="List the bundled presets.")
    presets.set_defaults(handler=_config_presets)

    verl = actions.add_parser(
        "verl",
        help="List the verl keys polyrl reads, and what each means here.",
        description="List the verl config keys polyrl accepts (polyrl/config/verl_compat.py).",
    )
    verl.set_defaults(handler=_config_verl)


def _config_show(args: argparse.Namespace) -> int:
    sys.stdout.write(to_yaml(config_from_args(args)))
    return 0


def _config_describe(args: argparse.Namespace) -> int:
    rows = describe(PolyRLConfig)
    out: list[str] = []
    if args.format == "markdown":
        out.append("| option | type | default | description |")
        out.append("| --- | --- | --- | --- |")
        for row in rows:
            cells = [f"`{row.key}`", f"`{row.type}`", f"`{inline_yaml(row.default)}`", row.help]
            out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    else:
        group = None
        for row in rows:
            this_group = row.key.rpartition(".")[0]
            if out and this_group != group:
                out.append("")
            group = this_group
            out.append(f"{row.key}: {row.type} = {inline_yaml(row.default)}")
            out.append(f"    {row.help}")
    sys.stdout.write("\n".join(out) + "\n")
    return 0


def _config_presets(args: argparse.Namespace) -> int:
    sys.stdout.write("\n".join(available_presets()) + "\n")
    return 0


def _config_verl(args: argparse.Namespace) -> int:
    from polyrl.config.verl_compat import markdown_table

    sys.stdout.write(markdown_table())
    return 0


@subcommand("serve", help="Serve a model for rollout over HTTP (generate, OpenAI API, control).")
def _serve_command(parser: argparse.ArgumentParser) -> Handler:
    from polyrl.rollout.options import (
        add_backend_arguments,
        add_limit_arguments,
        add_listen_arguments,
    )

    add_listen_arguments(parser)
    parser.add_argument(
        "--replicas", type=int, default=1, help="engine replicas behind one port (default 1)"
    )
    add_backend_arguments(parser)
    add_limit_arguments(parser)

    def run(args: argparse.Namespace) -> int:
        if args.replicas < 1:
            raise CLIError(f"--replicas must be >= 1, got {args.replicas}")
        from polyrl.rollout.base import BACKENDS

        if args.backend not in BACKENDS:
            raise CLIError(BACKENDS.unknown_message(args.backend))
        from polyrl.rollout.options import api_key_from_env, backend_options, limits_from_args
        from polyrl.workers.rollout_server import serve_command

        try:
            limits = limits_from_args(args)
        except ValueError as exc:
            raise CLIError(str(exc)) from exc
        try:
            return serve_command(
                args.model_dir,
                host=args.host,
                port=args.port,
                replicas=args.replicas,
                backend=args.backend,
                api_key=api_key_from_env(),
                ready_file=args.ready_file,
                log_level=args.log_level,
                options=backend_options(args),
                limits=limits,
                insecure=args.insecure,
            )
        except (ValueError, TypeError, OSError, RuntimeError) as exc:
            raise CLIError(str(exc)) from exc

    return run


@subcommand("sft", help="Supervised fine-tuning on chat data (loss on assistant tokens only).")
def _sft_command(parser: argparse.ArgumentParser) -> Handler:
    add_config_arguments(parser)

    def run(args: argparse.Namespace) -> int:
        cfg = config_from_args(args)
        from polyrl.core.multimodal import MultiModalInputError
        from polyrl.model_engine.checkpoint import CorruptCheckpointError
        from polyrl.trainer.sft import run_sft
        from polyrl.trainer.sft_data import SFTDataError
        from polyrl.trainer.tracking import TrackerUnavailableError

        user_errors = (
            SFTDataError,
            MultiModalInputError,
            TrackerUnavailableError,
            FileNotFoundError,
            CorruptCheckpointError,
        )
        try:
            run_sft(cfg)
        except user_errors as exc:
            raise CLIError(str(_cause(exc))) from exc
        except Exception as exc:
            cause = _cause(exc)
            if cause is exc or not isinstance(cause, user_errors):
                raise
            raise CLIError(str(cause)) from exc
        return 0

    return run


def _preference_command(kind: str) -> Setup:
    """Return the setup of ``polyrl dpo`` / ``polyrl rm``: a config, then the trainer."""

    def setup(parser: argparse.ArgumentParser) -> Handler:
        add_config_arguments(parser)

        def run(args: argparse.Namespace) -> int:
            cfg = config_from_args(args)
            from polyrl.model_engine.checkpoint import CorruptCheckpointError
            from polyrl.trainer.preference import run_preference
            from polyrl.trainer.preference_data import PreferenceDataError
            from polyrl.trainer.sft_data import SFTDataError
            from polyrl.trainer.tracking import TrackerUnavailableError

            user_errors = (
                PreferenceDataError,
                SFTDataError,
                TrackerUnavailableError,
                FileNotFoundError,
                CorruptCheckpointError,
            )
            try:
                run_preference(cfg, kind)
            except user_errors as exc:
                raise CLIError(str(exc)) from exc
            return 0

        return run

    return setup


subcommand("dpo", help="DPO (or IPO, SimPO) on preference pairs: prompt, chosen, rejected.")(
    _preference_command("dpo")
)
subcommand("rm", help="Reward-model training on preference pairs (Bradley-Terry loss).")(
    _preference_command("rm")
)


@subcommand("train", help="RL training (GRPO, PPO, RLOO, REINFORCE++, ReMax, PRIME) on a preset.")
def _train_command(parser: argparse.ArgumentParser) -> Handler:
    add_config_arguments(parser)

    def run(args: argparse.Namespace) -> int:
        cfg = config_from_args(args)
        from polyrl.core.multimodal import MultiModalInputError
        from polyrl.core.prompts import PromptTooLongError
        from polyrl.data.schema import RowValidationError
        from polyrl.model_engine.checkpoint import CorruptCheckpointError
        from polyrl.reward import RewardFunctionError
        from polyrl.reward.manager import RewardFailureError
        from polyrl.trainer.rl import run_rl
        from polyrl.trainer.tracking import TrackerUnavailableError

        user_errors = (
            TrackerUnavailableError,
            FileNotFoundError,
            RowValidationError,
            MultiModalInputError,
            RewardFunctionError,
            RewardFailureError,
            CorruptCheckpointError,
            PromptTooLongError,
        )
        try:
            run_rl(cfg)
        except user_errors as exc:
            raise CLIError(str(_cause(exc))) from exc
        except Exception as exc:
            cause = _cause(exc)
            if cause is exc or not isinstance(cause, user_errors):
                raise
            raise CLIError(str(cause)) from exc
        return 0

    return run


@subcommand("export", help="Turn a saved checkpoint into a Hugging Face model directory (CPU).")
def _export_command(parser: argparse.ArgumentParser) -> Handler:
    parser.add_argument(
        "checkpoint",
        metavar="CHECKPOINT",
        help="a global_step_<N> directory, a folder of them (newest taken), or a run's "
        "output_dir (its actor checkpoints)",
    )
    parser.add_argument("out", metavar="OUT", help="Hugging Face model directory to write")
    parser.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="base model directory for config and tokenizer (default: the one the checkpoint "
        "records)",
    )
    parser.add_argument(
        "--dtype", default=None, help="weight dtype (default: the checkpoint's, e.g. float32)"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing model directory at OUT"
    )

    def run(args: argparse.Namespace) -> int:
        from transformers.utils import logging as hf_logging

        from polyrl.model_engine.export import CheckpointExportError, export_checkpoint

        hf_logging.disable_progress_bar()  # one line out, one line for an error
        try:
            result = export_checkpoint(
                args.checkpoint,
                args.out,
                model_dir=args.model,
                dtype=args.dtype,
                overwrite=args.overwrite,
            )
        except CheckpointExportError as exc:
            raise CLIError(str(exc)) from exc
        print(f"exported step {result.step} of {result.checkpoint} to {result.directory}")
        return 0

    return run


@subcommand(
    "agent-proxy",
    help="OpenAI-compatible recording proxy: agents' calls become drift-free trajectories.",
)
def _agent_proxy_command(parser: argparse.ArgumentParser) -> Handler:
    parser.add_argument(
        "--rollout",
        action="append",
        required=True,
        metavar="URL",
        help="rollout server (or router) URL; repeat for several replicas",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="local directory of the served model's tokenizer (default: the model id the "
        "rollout server reports in /v1/models, when it is a local directory)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8100, help="port (default 8100; 0 = any)")
    parser.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="key callers must send as 'Authorization: Bearer KEY' (several: comma-separated); "
        "prefer the POLYRL_PROXY_API_KEY environment variable, which ps does not show. "
        "Without either, the rollout server's key (POLYRL_API_KEY) is the proxy's key too",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="allow listening beyond loopback without a key (anyone reaching it can use it)",
    )
    parser.add_argument("--model-name", default="polyrl", help="model name shown in answers")
    parser.add_argument("--ready-file", default=None, help="write {'url', 'pid'} here when up")
    parser.add_argument("--log-level", default="warning", help="uvicorn log level")
    parser.add_argument(
        "--chat-template-kwargs",
        default=None,
        metavar="MAPPING",
        help="extra chat-template arguments as a YAML/JSON mapping, e.g. "
        "'{enable_thinking: false}': the trainer's data.apply_chat_template_kwargs",
    )

    def run(args: argparse.Namespace) -> int:
        from polyrl.agent.proxy import PROXY_API_KEY_ENV, serve_proxy, tokenizer_dir_from_server
        from polyrl.core.http_guard import exposure_problem, insecure_warning, is_loopback
        from polyrl.core.prompts import check_template_kwargs
        from polyrl.rollout.client import RolloutClient
        from polyrl.rollout.options import api_key_from_env

        for url in args.rollout:
            if not url.startswith(("http://", "https://")):
                raise CLIError(f"--rollout {url!r} must start with http:// or https://")
        template_kwargs = None
        if args.chat_template_kwargs is not None:
            try:
                parsed = yaml.safe_load(args.chat_template_kwargs)
                if not isinstance(parsed, dict):
                    raise TypeError(f"expected a mapping, got {parsed!r}")
                template_kwargs = check_template_kwargs(parsed)
            except (yaml.YAMLError, TypeError, ValueError) as exc:
                raise CLIError(f"--chat-template-kwargs: {exc}") from exc
        api_key = api_key_from_env()
        raw_keys = args.api_key or os.environ.get(PROXY_API_KEY_ENV) or ""
        proxy_keys = [k.strip() for k in raw_keys.split(",") if k.strip()]
        if not proxy_keys and api_key:
            # Never forward with the server's key for callers who do not know a key.
            proxy_keys = [api_key]
        hint = f"set {PROXY_API_KEY_ENV} (or --api-key)"
        problem = exposure_problem(args.host, bool(proxy_keys), args.insecure, hint)
        if problem is not None:
            raise CLIError(problem)
        if not proxy_keys and args.insecure and not is_loopback(args.host):
            print(insecure_warning(args.host, "the agent proxy"), file=sys.stderr, flush=True)
        try:
            tokenizer = args.tokenizer or tokenizer_dir_from_server(args.rollout[0], api_key)
        except ValueError as exc:
            raise CLIError(str(exc)) from exc
        if not os.path.isdir(tokenizer):
            raise CLIError(f"--tokenizer {tokenizer!r} is not a directory")
        serve_proxy(
            RolloutClient(list(args.rollout), api_key=api_key),
            tokenizer,
            host=args.host,
            port=args.port,
            model_name=args.model_name,
            ready_file=args.ready_file,
            log_level=args.log_level,
            api_keys=proxy_keys,
            apply_chat_template_kwargs=template_kwargs,
        )
        return 0

    return run


def _cause(exc: BaseException) -> BaseException:
    """Return the error a remote worker raised (Ray task errors keep it in ``cause``), or exc."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``polyrl`` command line; return the exit code.

    Args:
        argv: Arguments without the program name; ``None`` reads ``sys.argv[1:]``.
    """
    from polyrl.core.errors import RunAbortedError

    parser = build_parser()
    args = None
    try:
        args = parser.parse_args(argv)
        code = args.handler(args)
        sys.stdout.flush()
        return 0 if code is None else int(code)
    except ConfigProblems as exc:  # every problem of the line, each on its own line
        problems = "".join(f"\n  {_one_line(p)}" for p in exc.problems)
        print(f"polyrl: error: {len(exc.problems)} problems:{problems}", file=sys.stderr)
        return USAGE_ERROR
    except (CLIError, ConfigError) as exc:
        print(f"polyrl: error: {_one_line(exc)}", file=sys.stderr)
        return USAGE_ERROR
    except RunAbortedError as exc:
        # A worker death the run could not recover from: the message says what and how to
        # resume; the traceback (driver-side frames of a remote failure) only helps debugging.
        if args is not None and getattr(args, "debug", False):
            raise
        print(f"polyrl: error: {_one_line(exc)}", file=sys.stderr)
        return USAGE_ERROR
    except SystemExit as exc:  # --help and --version exit through argparse
        return exc.code if isinstance(exc.code, int) else 0
    except BrokenPipeError:
        # The reader went away (`polyrl config describe | head`): silence the final flush.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
