"""`cacheclip bench recompute-profile`: torch.profiler's operators of one request's selective
recompute, beside a full prefill."""

from __future__ import annotations

from cacheclip_rag.analysis import describe_cpu

from .. import harness as h
from .. import recompute_profile

NAME = "recompute-profile"
HELP = "torch.profiler's operators of one selective recompute beside a full prefill"


def arguments(p) -> None:
    h.one_request_flags(p)
    p.add_argument("--no-full", action="store_true", help="skip the full prefill")
    h.out_flags(p)


def measure(args) -> h.Report:
    result = recompute_profile.run(h.engine(args), args.length, ratio=args.ratio, full=not args.no_full)
    return h.Report([recompute_profile.report(result)],
                    json=lambda path: recompute_profile.write_json(result, path, describe_cpu()))
