"""Write the deployment files rendered from envoy/fail-open.yaml (extproc.stack.deploy).

    python scripts/gen_deploy.py          # rewrite them
    python scripts/gen_deploy.py --check  # exit 1 if any is stale (what tests/deploy checks)
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from extproc.stack.deploy import compose_envoy_config, gateway_values, istio_envoyfilter, istio_gateway, preamble

ROOT = Path(__file__).resolve().parents[1]


class _NoAliases(yaml.SafeDumper):
    """Repeat shared lists in full: `&id001` anchors are valid YAML but opaque to a reader."""

    def ignore_aliases(self, data) -> bool:  # type: ignore[no-untyped-def]
        return True


def rendered() -> dict[Path, str]:
    """Repository path → file text (the Istio files from deploy/istio/values.yaml)."""
    values = gateway_values()

    def dump(what: str, data: dict | list) -> str:
        if isinstance(data, list):
            return preamble(what) + yaml.dump_all(data, Dumper=_NoAliases, sort_keys=False, width=120)
        return preamble(what) + yaml.dump(data, Dumper=_NoAliases, sort_keys=False, width=120)

    return {
        ROOT / "deploy/compose/envoy.yaml": dump("the compose network's addresses", compose_envoy_config()),
        ROOT / "deploy/istio/envoyfilter-gateway.yaml": dump("Istio ingress gateway", istio_envoyfilter("gateway", values=values)),
        ROOT / "deploy/istio/envoyfilter-sidecar.yaml": dump("Istio client sidecars", istio_envoyfilter("sidecar", values=values)),
        ROOT / "deploy/istio/envoyfilter-gateway-tier.yaml": dump("Istio ingress gateway, tier mode", istio_envoyfilter("gateway", "tier", values=values)),
        ROOT / "deploy/istio/gateway.yaml": dump("deploy/istio/values.yaml: Gateway, VirtualService, DestinationRule", istio_gateway(values)),
    }


def main(argv: list[str]) -> int:
    stale = []
    for path, text in rendered().items():
        if path.is_file() and path.read_text(encoding="utf-8") == text:
            continue
        stale.append(path.relative_to(ROOT))
        if "--check" not in argv:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    for p in stale:
        print(f"{'stale' if '--check' in argv else 'wrote'}: {p}")
    return 1 if stale and "--check" in argv else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
