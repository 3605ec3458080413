"""The compose `monitoring` profile: Prometheus scraping every service, Grafana with the dashboard.

    docker compose -f deploy/docker-compose.cpu.yml --profile monitoring up -d
    # Grafana: http://127.0.0.1:3000 (admin/admin at first), dashboard pdserve/pdserve
    # Prometheus: http://127.0.0.1:9090

deploy/compose.py adds both services to every file it writes; without `--profile monitoring`
compose starts neither. Prometheus's scrape config is the one deploy.local writes
(deploy/observability/prometheus.py), for the file's own services: a GPU worker service by its
name, a scaled CPU service by every address its name resolves to (Docker's DNS), so that
`--scale decode=3` is scraped without an edit. It reaches the container through an environment
variable the entrypoint writes to a file: compose files of this version cannot hold a file's
content. Grafana is provisioned from deploy/observability/grafana/provisioning (the data source
and the dashboard folder) and mounts the generated dashboard JSON. Both publish on 127.0.0.1
only: neither asks for credentials beyond Grafana's first admin login.
"""

from __future__ import annotations

import yaml

from deploy.observability import prometheus

PROFILE = "monitoring"
PROMETHEUS_IMAGE = "prom/prometheus:v2.53.0"
GRAFANA_IMAGE = "grafana/grafana:11.1.0"
PROMETHEUS_PORT, GRAFANA_PORT = 9090, 3000
SCRAPE_INTERVAL_S = 5.0
CONFIG_VARIABLE = "PDSERVE_PROMETHEUS_CONFIG"
DATA_VOLUME = "prometheus-data"
# relative to the compose file, which lives in deploy/
PROVISIONING = "./observability/grafana/provisioning"
DASHBOARD = "./observability/grafana/pdserve.json"
DASHBOARDS_DIR = "/var/lib/grafana/dashboards/pdserve"  # provisioning/dashboards/pdserve.yml


def prometheus_service(targets: dict[str, list[str]]) -> dict:
    """`targets`: pool → the URLs (`http://NAME:PORT` or `dns://NAME:PORT`) of its services."""
    config = prometheus.scrape_config(targets, SCRAPE_INTERVAL_S)
    start = (
        f'printf "%s" "$${CONFIG_VARIABLE}" > /tmp/prometheus.yml'
        " && exec /bin/prometheus --config.file=/tmp/prometheus.yml"
        " --storage.tsdb.path=/prometheus --storage.tsdb.retention.time=15d"
        f" --web.listen-address=:{PROMETHEUS_PORT}"
    )
    return {
        "image": PROMETHEUS_IMAGE,
        "profiles": [PROFILE],
        "entrypoint": ["/bin/sh", "-c", start],
        "restart": "unless-stopped",
        "environment": {CONFIG_VARIABLE: yaml.safe_dump(config, sort_keys=False)},
        "volumes": [f"{DATA_VOLUME}:/prometheus"],
        "ports": [f"127.0.0.1:{PROMETHEUS_PORT}:{PROMETHEUS_PORT}"],
    }


def grafana_service() -> dict:
    return {
        "image": GRAFANA_IMAGE,
        "profiles": [PROFILE],
        "restart": "unless-stopped",
        "volumes": [
            f"{PROVISIONING}:/etc/grafana/provisioning:ro",
            f"{DASHBOARD}:{DASHBOARDS_DIR}/pdserve.json:ro",
        ],
        "ports": [f"127.0.0.1:{GRAFANA_PORT}:{GRAFANA_PORT}"],
        "depends_on": ["prometheus"],
    }


def services(targets: dict[str, list[str]]) -> dict[str, dict]:
    """The profile's services by name, and the volume Prometheus keeps its data in."""
    return {"prometheus": prometheus_service(targets), "grafana": grafana_service()}
