"""The README's first command: a local 3-server cluster, a ResNet-50-sized push, a bit-exact pull.

    python -m deploy.demo [--keep] [--dir DIR]

Starts the cluster (deploy.local.LocalCluster) in a temporary folder, saves a
generated ResNet-50 state dict as .safetensors, pushes it with tag ``prod``
(the same code ``paramctl push`` runs), pulls it back by tag, compares every
tensor byte for byte, then pushes a fine-tune that changes ~10% of the bytes
and shows that only those chunks were sent. Exits non-zero on any mismatch.
"""
from __future__ import annotations

import random
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Mapping, Sequence

import torch
from rich.console import Console

from deploy.local import LauncherError, LocalCluster, LocalClusterConfig
from paramserver.client.ctl import human_bytes, push_summary
from paramserver.client.errors import ClientError
from paramserver.client.progress import RichProgress
from paramserver.client.pull import PullReport, pull
from paramserver.client.session import ClusterClient
from paramserver.wire.cli_args import OneLineParser
from paramserver.client.push import push
from worker.config import CacheConfig
from worker.loader import load


def finetune_bytes(state: Mapping[str, torch.Tensor], fraction: float = 0.1, seed: int = 1) -> tuple[dict[str, torch.Tensor], int]:
    """A copy with randomly chosen float tensors nudged until about ``fraction`` of the bytes changed."""
    names = sorted(k for k, v in state.items() if v.is_floating_point() and v.numel() > 0)
    random.Random(seed).shuffle(names)
    budget = fraction * sum(v.numel() * v.element_size() for v in state.values())
    gen = torch.Generator().manual_seed(seed)
    out = dict(state)
    changed = 0
    for name in names:
        t = state[name]
        size = t.numel() * t.element_size()
        if changed + size > budget * 1.05:
            continue  # too big to stay near the target; a smaller tensor may fit
        out[name] = (t.float() + 1e-3 * torch.randn(t.shape, generator=gen)).to(t.dtype)
        changed += size
        if changed >= budget * 0.95:
            break
    return out, changed


def mismatches(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> list[str]:
    def raw(t: torch.Tensor) -> bytes:
        t = t.contiguous()
        return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""

    bad = sorted(set(got) ^ set(want))
    for name in sorted(set(got) & set(want)):
        a, b = got[name], want[name]
        if a.dtype != b.dtype or a.shape != b.shape or raw(a) != raw(b):
            bad.append(name)
    return bad


def pull_summary(r: PullReport) -> str:
    return (
        f"pulled {r.model}:{r.tag} v{r.version} -> {r.path}\n"
        f"  {human_bytes(r.bytes_total)} in {r.chunks_total} chunks, every one verified against the manifest (size + CRC32C)  "
        f"{r.seconds:.2f} s  {r.gbps:.2f} GB/s (fetch + verify {r.fetch_gbps:.2f} GB/s)"
    )


def run(root: Path, keep: bool, servers: int, console: Console) -> int:
    from safetensors.torch import load_file, save_file

    from chunking.synthetic import resnet50_state_dict

    # Secure as 'deploy.local up' is: generated tokens and cluster secret, in 0600 files.
    cluster = LocalCluster(LocalClusterConfig(root=root / "cluster", servers=servers, generate_secrets=True))
    console.print(f"[bold]1.[/bold] starting a local {servers}-server cluster under {cluster.root} ...")
    try:
        cluster.up(wait=90)
    except BaseException:
        cluster.down()
        raise
    ok = False
    try:
        console.print(f"   up: {', '.join(f'{s.server_id} {s.grpc}' for s in cluster.slots)}; "
                      f"tokens and cluster secret generated under {cluster.root / 'secrets'}")
        admin, read = cluster.config.admin_token, cluster.config.read_token
        state = resnet50_state_dict()
        model_file = root / "resnet50.safetensors"
        save_file(state, str(model_file))
        console.print(f"[bold]2.[/bold] generated a ResNet-50 ({len(state)} tensors, "
                      f"{human_bytes(model_file.stat().st_size)}) -> {model_file}")

        console.print("[bold]3.[/bold] paramctl push resnet50.safetensors --model resnet50 --tag prod")
        with RichProgress(console=console) as bar:
            first = push(cluster.seed, str(model_file), model="resnet50", tag="prod", progress=bar, token=admin)
        console.print(push_summary(first), highlight=False)

        console.print("[bold]4.[/bold] paramctl pull resnet50:prod --out resnet50.pulled.safetensors")
        out = root / "resnet50.pulled.safetensors"
        with RichProgress(console=console) as bar:
            pulled = pull(cluster.seed, "resnet50:prod", out, progress=bar, token=read)
        console.print(pull_summary(pulled), highlight=False)
        bad = mismatches(load_file(str(out)), load_file(str(model_file)))
        if bad:
            console.print(f"[red]MISMATCH[/red] in {len(bad)} tensors, e.g. {bad[:5]}")
            return 1
        console.print(f"   [green]bit-exact[/green]: all {len(state)} tensors match the pushed file byte for byte")

        console.print("[bold]4b.[/bold] paramworker load resnet50:prod   (the worker's path: the same client, its cache tiers)")
        with ClusterClient(cluster.addresses, token=read) as client:
            loaded = load(client, "resnet50:prod", "cpu", CacheConfig())
        console.print(f"   {loaded.report.summary()}", highlight=False)
        bad = mismatches(loaded.tensors, state)
        if bad:
            console.print(f"[red]MISMATCH[/red] in the worker's load: {bad[:5]}")
            return 1
        console.print(f"   [green]bit-exact[/green]: the worker holds all {len(state)} tensors byte for byte")
        del loaded

        tuned, changed = finetune_bytes(state, 0.10)
        console.print(f"[bold]5.[/bold] push a fine-tune that changes {100 * changed / first.bytes_total:.1f}% of the bytes, tag prod")
        with RichProgress(console=console) as bar:
            second = push(cluster.seed, tuned, model="resnet50", tag="prod", progress=bar, token=admin)
        console.print(push_summary(second), highlight=False)
        console.print(
            f"   only {human_bytes(second.bytes_sent)} of {human_bytes(second.bytes_stored)} sent "
            f"({100 * second.bytes_sent / max(1, second.bytes_stored):.1f}%); {second.chunks_deduplicated} of "
            f"{second.chunks_unique} chunks were already in the cluster"
        )
        with RichProgress(console=console) as bar:
            again = pull(cluster.seed, "resnet50:prod", root / "resnet50.v2.safetensors", progress=bar, token=read)
        bad = mismatches(load_file(str(root / "resnet50.v2.safetensors")), tuned)
        if bad or again.version != second.version:
            console.print(f"[red]MISMATCH[/red] after the fine-tune: {bad[:5]} (pulled v{again.version}, pushed v{second.version})")
            return 1
        console.print(f"   [green]bit-exact[/green]: resnet50:prod is now v{again.version}, pulled at {again.gbps:.2f} GB/s")
        ok = True
        return 0
    finally:
        if keep and ok:
            console.print(
                f"\ncluster left running. Try:\n"
                f"  export PARAMS_CONFIG={cluster.client_config_path}\n"
                f"  paramctl status\n  paramctl ls resnet50\n  paramctl rollback resnet50 prod\n"
                f"  paramctl pull resnet50:prod --out /tmp/resnet50.safetensors\n"
                f"stop it with:  python -m deploy.local down --dir {cluster.root}"
            )
        else:
            cluster.down()


def main(argv: Sequence[str] | None = None) -> int:
    p = OneLineParser(prog="python -m deploy.demo", description=__doc__.splitlines()[0])
    p.add_argument("--keep", action="store_true",
                   help="leave the cluster running and print how to use paramctl against it (default: stop it)")
    p.add_argument("--dir", type=Path, default=None, help="working folder (default: a temporary folder, removed at the end unless --keep)")
    p.add_argument("--servers", type=int, default=3, help="number of servers (default 3)")
    args = p.parse_args(argv)
    console = Console()
    root = args.dir or Path(tempfile.mkdtemp(prefix="pdparams-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        return run(root.resolve(), args.keep, args.servers, console)
    except (LauncherError, ClientError) as exc:
        print(f"demo: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("demo: interrupted", file=sys.stderr)
        return 130
    finally:
        if args.dir is None and not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
