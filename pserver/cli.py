"""``ps-server``: start one pserver role from the environment (or flags).

    TRAINING_ROLE=PSERVER PADDLE_PSERVERS_IP_PORT_LIST=127.0.0.1:6170,127.0.0.1:6171 \\
    PADDLE_TRAINERS_NUM=2 POD_IP=127.0.0.1 PADDLE_PORT=6170 \\
        ps-server --program examples/train_mlp.py:build_program

The program reference names a function returning the same ``Program`` the
trainers transpile; config flags must match theirs (a mismatch is refused at
the trainers' first call with a "plan mismatch" error).
"""

from __future__ import annotations

import argparse
import logging
import sys

from transpiler import DistributeTranspiler, RoleEnv
from transpiler.cli import add_transpile_arguments, config_from_args, load_program

from .errors import LostLead
from .layout.joining import LeftJob
from .server import ParameterServer

log = logging.getLogger("pserver")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="ps-server", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--program", required=True, help="FILE.py:FUNC or module:FUNC returning a transpiler.Program"
    )
    parser.add_argument("--endpoint", help="this pserver's endpoint (default: POD_IP:PADDLE_PORT)")
    parser.add_argument("--pservers", help="all pserver endpoints (default: PADDLE_PSERVERS_IP_PORT_LIST)")
    parser.add_argument("--trainers", type=int, help="number of trainers (default: PADDLE_TRAINERS_NUM)")
    parser.add_argument(
        "--tables_from",
        help="start the distributed tables from this directory "
        "(written by Trainer.save_tables; any pserver count)",
    )
    parser.add_argument("--log_level", default="INFO", help="logging level (default INFO)")
    add_transpile_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        env = RoleEnv.from_env() if not (args.endpoint and args.pservers and args.trainers) else None
        if env is not None and env.is_pserver is False:
            raise ValueError("TRAINING_ROLE is TRAINER; ps-server runs pserver roles only")
        endpoint = args.endpoint or (env and env.current_endpoint)
        pservers = args.pservers or (env and env.pserver_list)
        trainers = args.trainers or (env and env.trainers)
        if not (endpoint and pservers and trainers):
            raise ValueError(
                "no role: set TRAINING_ROLE=PSERVER and the PADDLE_* variables, or give "
                "--endpoint, --pservers and --trainers"
            )
        program = load_program(args.program)
        t = DistributeTranspiler(config_from_args(args))
        t.transpile(0, program=program, pservers=pservers, trainers=trainers, sync_mode=args.sync_mode)
        ps_program = t.get_pserver_program(endpoint)
        server = ParameterServer(
            ps_program, t.get_startup_program(endpoint, ps_program), tables_from=args.tables_from
        )
    except LeftJob as e:
        print(f"ps-server: {e}", file=sys.stderr)
        return 0
    except (ValueError, TypeError, TimeoutError) as e:
        print(f"ps-server: error: {e}", file=sys.stderr)
        return 2
    try:
        server.serve()
    except OSError as e:
        print(f"ps-server: error: {e}", file=sys.stderr)
        return 1
    except LostLead as e:
        print(f"ps-server: {e}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
