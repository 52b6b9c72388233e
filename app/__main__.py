"""`python -m app` (what `./launch.sh` runs): serve the web app.

    python -m app [--host 127.0.0.1] [--port 7860] [--output-dir runs] [--username U --password P]

Environment: LIVETUNE_HOST, LIVETUNE_PORT, LIVETUNE_OUTPUT_DIR, LIVETUNE_USERNAME,
LIVETUNE_PASSWORD (the flags win). Loopback by default, Gradio's share link never. A port that is
taken, or a host that cannot be bound, ends the program with a clear message and exit code 1.
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
    parser.add_argument("--username", default=env("LIVETUNE_USERNAME"), help="require this user name")
    parser.add_argument("--password", default=env("LIVETUNE_PASSWORD"), help="and this password")
    args = parser.parse_args(argv)
    if bool(args.username) != bool(args.password):
        parser.error("give both --username and --password, or neither")
    if not 0 < args.port < 65536:
        parser.error(f"--port must be between 1 and 65535, got {args.port}")
    return args


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
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.username:
        print(f"livetune: warning: serving on {args.host} without --username/--password; anyone who "
              "can reach this address can start runs", file=sys.stderr)
    from app.web import build_app, launch_options  # imported late: Gradio takes seconds to load
    from app.web.backend import Backend

    backend = Backend(args.output_dir)
    demo = build_app(backend)
    demo.queue(default_concurrency_limit=4)
    auth = (args.username, args.password) if args.username else None
    print(f"livetune: serving on http://{args.host}:{args.port} (runs in {backend.output_dir})", flush=True)
    try:
        demo.launch(server_name=args.host, server_port=args.port, share=False, auth=auth,
                    inbrowser=False, show_error=False, quiet=True, **launch_options())
    except OSError as e:  # e.g. the port was taken between the check and the launch
        print(f"livetune: cannot serve on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    finally:
        backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
