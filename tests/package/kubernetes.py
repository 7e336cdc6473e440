#!/usr/bin/env python3
"""The Kubernetes files of deploy/kubernetes are valid objects of their kinds, and what the
opt-in pod mounts and sets is exactly what the OCI hook adds (`memloop container hook`, run
here on a minimal configuration): the files cannot drift from the code. No cluster is needed
(none runs here); see deploy/kubernetes/README.md for what this does not show.

usage: tests/package/kubernetes.py [MEMLOOP]  (default target/release/memloop)"""

import json
import os
import subprocess
import sys
import tempfile

import yaml

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
KUBE = os.path.join(ROOT, "deploy", "kubernetes")
MEMLOOP = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "target", "release", "memloop")


def fail(why):
    print(f"kubernetes: FAILED: {why}", file=sys.stderr)
    sys.exit(1)


def load(name):
    docs = list(yaml.safe_load_all(open(os.path.join(KUBE, name))))
    if len(docs) != 1:
        fail(f"{name}: {len(docs)} documents, want 1")
    return docs[0]


def need(obj, path, what):
    for key in path:
        if not isinstance(obj, dict) or key not in obj:
            fail(f"{what}: no {'.'.join(path)}")
        obj = obj[key]
    return obj


def hook_output():
    """The hook's mounts and environment for a container annotated with a scratch region."""
    with tempfile.TemporaryDirectory() as d:
        region = os.path.join(d, "region")
        config = {"annotations": {"io.memloop.region": region}, "mounts": [],
                  "process": {"env": ["PATH=/bin"]}}
        r = subprocess.run([MEMLOOP, "container", "hook"], input=json.dumps(config),
                           capture_output=True, text=True)
        subprocess.run([MEMLOOP, "region", "destroy", "--region", region], capture_output=True)
        if r.returncode != 0 or r.stderr.strip():
            fail(f"memloop container hook: {r.stderr.strip()}")
        out = json.loads(r.stdout)
        mounts = {m["destination"]: (m["source"], "ro" in m["options"]) for m in out["mounts"]}
        env = dict(e.split("=", 1) for e in out["process"]["env"])
        return region, mounts, env


def main():
    ds = load("daemonset.yaml")
    if (ds.get("apiVersion"), ds.get("kind")) != ("apps/v1", "DaemonSet"):
        fail("daemonset.yaml is not an apps/v1 DaemonSet")
    labels = need(ds, ["spec", "template", "metadata", "labels"], "daemonset.yaml")
    if need(ds, ["spec", "selector", "matchLabels"], "daemonset.yaml").items() - labels.items():
        fail("daemonset.yaml: the selector does not match the pod template's labels")
    pod_spec = need(ds, ["spec", "template", "spec"], "daemonset.yaml")
    volumes = {v["name"] for v in pod_spec["volumes"]}
    for c in pod_spec["initContainers"] + pod_spec["containers"]:
        for vm in c.get("volumeMounts", []):
            if vm["name"] not in volumes:
                fail(f"daemonset.yaml: {c['name']} mounts unknown volume {vm['name']}")

    pod = load("pod-opt-in.yaml")
    if (pod.get("apiVersion"), pod.get("kind")) != ("v1", "Pod"):
        fail("pod-opt-in.yaml is not a v1 Pod")
    if "io.memloop.region" not in need(pod, ["metadata", "annotations"], "pod-opt-in.yaml"):
        fail("pod-opt-in.yaml lacks the opt-in annotation")
    container = pod["spec"]["containers"][0]
    vols = {v["name"]: v["hostPath"]["path"] for v in pod["spec"]["volumes"]}
    pod_mounts = {m["mountPath"]: (vols[m["name"]], bool(m.get("readOnly")))
                  for m in container["volumeMounts"]}
    pod_env = {e["name"]: e["value"] for e in container["env"]}

    region, mounts, env = hook_output()
    host_of = {region: "/dev/shm/memloop-default", region + ".wake": "/dev/shm/memloop-default.wake"}
    for dest, (src, ro) in mounts.items():
        if dest not in pod_mounts:
            fail(f"pod-opt-in.yaml does not mount {dest}, which the hook does")
        # The libraries (the shim and its engine) under their own names.
        want = host_of.get(src, "/opt/memloop/lib/" + src.rsplit("/", 1)[-1])
        if pod_mounts[dest] != (want, ro):
            fail(f"pod-opt-in.yaml mounts {pod_mounts[dest]} at {dest}, want {(want, ro)}")
    if set(pod_mounts) != set(mounts):
        fail(f"pod-opt-in.yaml mounts {sorted(pod_mounts)}, the hook {sorted(mounts)}")
    for name in ("LD_PRELOAD", "MEMLOOP_REGION"):
        if pod_env.get(name) != env.get(name):
            fail(f"pod-opt-in.yaml sets {name}={pod_env.get(name)}, the hook {env.get(name)}")
    print("kubernetes: ok: daemonset.yaml and pod-opt-in.yaml are well-formed; the pod mounts "
          f"and sets what the hook does ({', '.join(sorted(mounts))})")


if __name__ == "__main__":
    main()
