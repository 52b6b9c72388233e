"""`python -m app` (what `./launch.sh` runs): serve the web app.

    python -m app [--host 127.0.0.1] [--port 7860] [--output-dir runs] [--users-file FILE] [--no-api]

Environment: LIVETUNE_HOST, LIVETUNE_PORT, LIVETUNE_OUTPUT_DIR (the flags win). Logins (app.users):
the users file (`python -m app.users add NAME [--role viewer]`, mode 0600, scrypt hashes), and/or
one operator from LIVETUNE_USERNAME / LIVETUNE_PASSWORD; never a password on the command line,
which every user of the machine can read (`ps`): `--password` is refused, saying so. With no login
at all, whoever reaches the page is an operator (fine on loopback, warned about elsewhere).
Loopback by default, Gradio's share link never. A port that is taken, or a host that cannot be
bound, ends the program with a clear message and exit code 1. The OpenAI-compatible API is served
on the same port under /v1 (app.web.openai_mount) unless `--no-api`.
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
import sys

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(prog="python -m app", description="Serve the livetune web app.")
    parser.add_argument("--host", default=env("LIVETUNE_HOST", "127.0.0.1"),
                        help="address to listen on (default 127.0.0.1, this machine only)")
    parser.add_argument("--port", type=int, default=int(env("LIVETUNE_PORT", "7860")),
                        help="port to listen on (default 7860)")
    parser.add_argument("--output-dir", default=env("LIVETUNE_OUTPUT_DIR", "runs"),
                        help="folder that holds the run folders (default ./runs)")
    parser.add_argument("--users-file", default=None,
                        help="the logins (default: $LIVETUNE_USERS_FILE, else <output dir>/.users; "
                             "written by `python -m app.users add NAME [--role viewer]`)")
    parser.add_argument("--no-api", action="store_true",
                        help="do not serve the OpenAI-compatible API under /v1 on this port (app.web.openai_mount)")
    # secrets never come from argv (`ps` shows it to every user): these exist only to say so
    parser.add_argument("--password", help=argparse.SUPPRESS)
    parser.add_argument("--username", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.password is not None or args.username is not None:
        parser.error(NO_ARGV_PASSWORD)
    if not 0 < args.port < 65536:
        parser.error(f"--port must be between 1 and 65535, got {args.port}")
    return args


NO_ARGV_PASSWORD = ("--username/--password are not taken on the command line, where every user of this "
                    "machine can read them (ps): set LIVETUNE_USERNAME and LIVETUNE_PASSWORD in the "
                    "environment, or add logins to a 0600 users file with `python -m app.users add NAME "
                    "[--role viewer]` (docs/access.md)")


def check_bindable(host: str, port: int) -> str | None:
    """Why (host, port) cannot be served, or None when it can."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return f"cannot resolve host {host!r}: {e.strerror}"
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # as the server itself will: a port left in TIME_WAIT by an earlier app is free
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return (f"port {port} on {host} is already in use (is the app already running?); "
                        f"pick another with --port or LIVETUNE_PORT")
            return f"cannot listen on {host}:{port}: {e.strerror}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = check_bindable(args.host, args.port)
    if problem:
        print(f"livetune: {problem}", file=sys.stderr)
        return 1
    from app.users import UsersError, default_file, logins
    try:  # the password leaves this process's environment here: the runs it starts never see it
        users = logins(args.output_dir, args.users_file)
    except UsersError as e:
        print(f"livetune: {e}", file=sys.stderr)
        return 1
    if args.host not in ("127.0.0.1", "localhost", "::1") and not users:
        print(f"livetune: warning: serving on {args.host} without a login ({default_file(args.output_dir)} "
              "or LIVETUNE_USERNAME/LIVETUNE_PASSWORD); anyone who can reach this address can start runs",
              file=sys.stderr)
    from app.web import build_app, launch_options  # imported late: Gradio takes seconds to load
    from app.web.access import use_logins
    from app.web.backend import Backend

    backend = Backend(args.output_dir)
    use_logins(backend, users)
    demo = build_app(backend)
    demo.queue(default_concurrency_limit=4)
    auth = users.check if users else None
    options, api = launch_options(), None
    if not args.no_api:  # the OpenAI-compatible API on this port too, under /v1
        from app.web.openai_mount import api_mount, api_note
        route, api = api_mount(args.output_dir)
        options["app_kwargs"] = {**options["app_kwargs"], "routes": [route]}
        print(api_note(f"http://{args.host}:{args.port}", args.output_dir), flush=True)
    print(f"livetune: serving on http://{args.host}:{args.port} (runs in {backend.output_dir})", flush=True)
    try:
        demo.launch(server_name=args.host, server_port=args.port, share=False, auth=auth,
                    inbrowser=False, show_error=False, quiet=True, **options)
    except OSError as e:  # e.g. the port was taken between the check and the launch
        print(f"livetune: cannot serve on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    finally:
        backend.close()
        if api is not None:
            api.state.runs.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
