"""`cacheclip store stats|verify|repair`: inspect or heal a store."""

from __future__ import annotations

from pathlib import Path

from ..request.profile_source import shipped
from .common import add_common, engine_from_args


def cmd_store(args) -> int:
    from ..storage.store import KVStore

    root = args.store
    if "://" not in root and not (Path(root) / "store.json").exists():
        raise ValueError(f"{args.store!r} is not a cacheclip store (no store.json)")
    store = KVStore(root)
    if not store.read_manifest():
        raise ValueError(f"{args.store!r} is not a cacheclip store (no manifest)")
    if args.action == "stats":
        usage = store.usage()
        bound = usage["max_bytes"]
        held = sum(info["bytes"] for info in usage["namespaces"].values())
        print(f"store {root}: {usage['chunks']} chunks, texts {usage['text_bytes'] / 2**20:.1f} MB, caches "
              f"{held / 2**20:.1f} MB" + (f" of a bound of {bound / 2**20:.1f} MB (least recently used dropped past it)"
                                        if bound else " (unbounded)"))
        print(f"  {'role':<8} {'model':<32} {'dtype/kv':<18} {'codec':<6} {'caches':>6} {'MB':>9} {'tokens':>9} "
              f"{'KiB/token':>9}")
        for ns, info in usage["namespaces"].items():
            dtypes = f"{info.get('dtype', '?')}/{info.get('kv_dtype', info.get('dtype', '?'))}"
            per_token = f"{info['bytes_per_token'] / 1024:>9.2f}" if info["bytes_per_token"] else f"{'-':>9}"
            print(f"  {info.get('role', '?'):<8} {info.get('model', '?'):<32} {dtypes:<18} {info['kv_codec']:<6} "
                  f"{info['caches']:>6} {info['bytes'] / 2**20:>9.1f} {info['tokens']:>9} {per_token}  "
                  f"(namespace {ns[:12]}, fingerprint {info.get('fingerprint', '?')[:12]})")
            if info.get("packets"):
                pk = info["packets"]
                print(f"           KV Packet adapters {pk['adapters']} ({pk['n_header']} header + {pk['n_trailer']} "
                      "trailer vectors); packet caches are built on first use or by `ingest --packets`")
        print("  memory tier: in-process, per engine (StoreConfig.memory_bytes); hit rates in `bench ttft` output")
        profiles = store.read_profiles()
        for profile in profiles:
            print(f"  selection profile: {profile.describe()} for {profile.primary_name} + {profile.aux_name}, "
                  f"calibrated at {list(profile.lengths)} tokens ({profile.created})")
        if not profiles:
            for line in shipped_profile_lines(usage["namespaces"].values()):
                print(line)
        return 0
    if args.action == "verify":
        report = store.verify()
        missing = sum(len(v) for v in report["missing"].values())
        print(f"checked {report['checked']} cache files: {len(report['damaged'])} damaged, "
              f"{missing} missing, {len(report['orphans'])} orphaned, {len(report['bad_texts'])} unreadable texts")
        for ns, name, why in report["damaged"]:
            print(f"  damaged: {ns[:12]}/{name}: {why}")
        return 0 if not (report["damaged"] or missing or report["bad_texts"]) else 1
    engine = engine_from_args(args)
    result = engine.repair(progress=not args.quiet)
    print(f"repaired store {root}: {result['damaged']} damaged files found, {result['rebuilt']} caches rebuilt "
          f"for {result['chunks']} chunks")
    return 0


def add_commands(sub) -> None:
    p = sub.add_parser("store", help="inspect or heal a store: stats, verify, repair")
    add_common(p)
    p.add_argument("action", choices=["stats", "verify", "repair"])
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_store)


def shipped_profile_lines(namespaces) -> list[str]:
    """What a store with no calibrated profile scores with: the package's profiles for each
    primary + aux pair its namespaces hold, else the aux model's last layer."""
    models = {role: {info.get("model") for info in namespaces if info.get("role") == role} for role in ("primary", "aux")}
    lines = []
    for primary in sorted(m for m in models["primary"] if m):
        for aux in sorted(m for m in models["aux"] if m):
            found = shipped(primary, aux)
            if found:
                lengths = sorted({n for p in found for n in p.lengths})
                lines.append(f"  selection profile: none stored; {primary} + {aux} scores with the package's "
                             f"profiles, calibrated at {lengths} tokens")
    return lines or ["  selection profile: none stored; requests score with the aux model's last layer until "
                     "`cacheclip calibrate` writes one"]
