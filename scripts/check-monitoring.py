"""The Prometheus Operator component (deploy/kubernetes/monitoring), for
scripts/check-deploy.

  check-monitoring.py rule ALERTS RULE [--write]
      RULE must hold exactly ALERTS' groups, each runbook_url behind the
      placeholder base that kustomize replaces; --write rewrites it first.
  check-monitoring.py render MONITORING_DIR OUT
      The component's objects with the replacement done as kustomize does
      it, for machines without kubectl.
  check-monitoring.py validate OBJECTS RUNBOOK_BASE DOC SCHEMA_DIR
      Every PrometheusRule and ServiceMonitor in OBJECTS matches its schema,
      every alert's runbook_url is RUNBOOK_BASE's url + DOC#<a heading>, and
      the runbook-base ConfigMap stays out of the cluster.
"""

import copy
import json
import os
import re
import sys

import jsonschema
import yaml

PLACEHOLDER = "https://runbook-base.invalid/"
DOC = "docs/operations.md"
HEADER = """\
# Generated from deploy/prometheus/alerts.yml by `scripts/check-deploy --write`;
# edit that file, not this one. runbook_url: kustomization.yaml replaces the
# placeholder base with runbook-base.yaml's url. Your Prometheus may select
# rules by a label (kube-prometheus-stack: release=<name>); add it to
# metadata.labels if so.
"""


def expected_rule(alerts_path):
    groups = copy.deepcopy(yaml.safe_load(open(alerts_path))["groups"])
    for g in groups:
        for r in g["rules"]:
            a = r.get("annotations", {})
            if "runbook_url" in a:
                a["runbook_url"] = PLACEHOLDER + a["runbook_url"]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "tradebucket", "labels": {"app.kubernetes.io/name": "tradebucket"}},
        "spec": {"groups": groups},
    }


def rule(alerts_path, rule_path, write=False):
    expected = expected_rule(alerts_path)
    if write:
        with open(rule_path, "w") as f:
            f.write(HEADER + yaml.safe_dump(expected, sort_keys=False, width=100))
    if yaml.safe_load(open(rule_path)) != expected:
        sys.exit(f"{rule_path} differs from {alerts_path}: run scripts/check-deploy --write")
    print(f"  {sum(len(g['rules']) for g in expected['spec']['groups'])} rules")


def render(mon, out):
    base = yaml.safe_load(open(f"{mon}/runbook-base.yaml"))["data"]["url"]
    docs = [yaml.safe_load(open(f"{mon}/{f}")) for f in ("servicemonitor.yaml", "prometheusrule.yaml")]
    for g in docs[1]["spec"]["groups"]:
        for r in g["rules"]:
            a = r.get("annotations", {})
            if "runbook_url" in a:
                a["runbook_url"] = base + DOC + a["runbook_url"].split(DOC, 1)[1]
    with open(out, "w") as f:
        yaml.safe_dump_all(docs, f)


def anchors(doc_path):
    # GitHub's anchors: lower case, punctuation dropped, spaces to hyphens.
    headings = re.findall(r"^#{1,6} +(.+?) *$", open(doc_path).read(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def validate(objects_path, base_path, doc_path, schema_dir):
    objects = [d for d in yaml.safe_load_all(open(objects_path)) if d]
    base = yaml.safe_load(open(base_path))["data"]["url"]
    if not re.match(r"^https?://\S+/$", base):
        sys.exit(f"{base_path}: url {base!r} must be an http(s) URL ending in /")
    schemas = {"PrometheusRule": "prometheusrule", "ServiceMonitor": "servicemonitor"}
    seen, bad = set(), []
    for o in objects:
        kind = o.get("kind")
        if kind == "ConfigMap" and o["metadata"]["name"] == "tradebucket-runbook-base":
            bad.append("the runbook-base ConfigMap would be applied to the cluster")
        if kind not in schemas:
            continue
        seen.add(kind)
        schema = json.load(open(os.path.join(schema_dir, schemas[kind] + ".schema.json")))
        for e in jsonschema.Draft7Validator(schema).iter_errors(o):
            bad.append(f"{kind}: {'/'.join(map(str, e.absolute_path))}: {e.message}")
        if kind == "PrometheusRule":
            bad += runbook_problems(o, base + DOC + "#", anchors(doc_path))
    if set(schemas) - seen:
        bad.append(f"missing: {sorted(set(schemas) - seen)}")
    if bad:
        sys.exit("\n  ".join(["Prometheus Operator objects:"] + bad))
    print(f"  {len(objects)} objects; {sorted(seen)} valid; runbook links start with {base}")


def runbook_problems(rule, prefix, known):
    bad = []
    for g in rule["spec"]["groups"]:
        for r in g["rules"]:
            url = r.get("annotations", {}).get("runbook_url", "")
            if "alert" in r and not (url.startswith(prefix) and url[len(prefix):] in known):
                bad.append(f"{r['alert']}: runbook_url {url!r} is not {prefix}<a heading>")
    return bad


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "rule":
        rule(args[0], args[1], write="--write" in args[2:])
    elif cmd == "render":
        render(*args)
    elif cmd == "validate":
        validate(*args)
    else:
        sys.exit(f"unknown command {cmd}")
