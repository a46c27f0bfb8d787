"""The one-call GPU check: GPU tests, the quickstart, loader / model / training benchmarks and the profiler on
one GPU, every step time-boxed, everything it writes packed under one folder.

    python3 tools/gpu_check.py [--out gpu_out] [--budget 420] [--wheel-parts /tmp/dali]
    python3 tools/gpu_check.py --dry-run --out DIR        (the same plumbing on a CPU, tiny sizes)

Runs on a machine's own interpreter as it is (a lent GPU machine has torch, transformers, accelerate, timm
and nvidia-ml-py, no network and no DALI): ``--wheel-parts DIR`` unpacks a wheel tar split into parts
(``cat DIR/part.*``, as ../shared/device/stage_dali.sh writes them) and installs the wheels with
``pip --no-index --no-deps --target DIR/site``; mmfast itself is used from this checkout, without a build,
through a copy of its ``mmfast/`` put first on PYTHONPATH (the source tree is the import tree); ``-c`` and
``-m`` commands run with ``-P`` so that the working directory cannot shadow it.

Steps run in order of value and stop being started when ``--budget`` seconds are spent; each step's log,
JSON and PNG go to ``OUT/gpu_check/``, packed at the end into ``OUT/gpu_check.tar.gz`` beside
``OUT/summary.json`` and ``OUT/log.txt`` (three files: a device call brings back at most eight).
Exit status: 0 when every step that ran passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
PACK_RESERVE_S = 10  # kept back from the budget for packing the outputs

ENV_SNIPPET = """
import json, platform, sys
info = {"python": sys.version.split()[0], "platform": platform.platform()}
import torch
info["torch"] = torch.__version__
info["cuda"] = torch.cuda.is_available()
if info["cuda"]:
    p = torch.cuda.get_device_properties(0)
    info.update(gpu=p.name, capability=f"{p.major}.{p.minor}", gpu_mem_gib=round(p.total_memory / 2**30, 1),
                multiprocessors=p.multi_processor_count, cuda_runtime=torch.version.cuda)
for mod in ("nvidia.dali", "torchvision", "transformers", "accelerate", "timm", "pynvml"):
    try:
        m = __import__(mod, fromlist=["_"])
        info[mod] = getattr(m, "__version__", "present")
    except Exception as e:
        info[mod] = f"missing: {e}"
import mmfast, mmfast.loading.graphs
info["mmfast"] = mmfast.__file__
print(json.dumps(info, indent=1))
"""


@dataclass
class Step:
    name: str
    argv: list[str]
    timeout: int  # seconds, at most (less when the budget is nearly spent)
    note: str = ""
    outputs: list[str] = field(default_factory=list)  # files the step should write, relative to the work dir


def test_paths() -> str:
    """pyproject's pytest ``pythonpath`` without the checkout itself ("."): the test folders, whose modules
    import each other by name, while mmfast is the one the check installed."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        paths = tomllib.load(f)["tool"]["pytest"]["ini_options"]["pythonpath"]
    return " ".join(p for p in paths if p != ".")


@dataclass(frozen=True)
class Sizes:
    """What a step runs on: the real sizes on a GPU, tiny ones for a dry run on a CPU."""

    dry: bool
    photos: Path  # the prepared photos (``prepared_photos`` puts them in the steps' MMFAST_CACHE)
    n_photos: int
    model: list[str]  # the write-up's models: ResNet-50 + BERT-base (random weights: no hub offline)
    size: str  # image size, px
    batch: str
    big_batch: str

    @classmethod
    def of(cls, cache: Path, dry: bool) -> Sizes:
        n_photos = 32 if dry else 512
        model = ["--preset", "tiny"] if dry else ["--preset", "resnet50-bert", "--text-model", "bert-base-random"]
        size, batch, big_batch = ("32", "8", "8") if dry else ("224", "64", "256")
        photos = cache / "bench" / f"prepared-photos-n{n_photos}"
        return cls(dry, photos, n_photos, model, size, batch, big_batch)

    def count(self, dry: int, real: int) -> str:
        """A step or round count as a flag value: ``dry`` in a dry run, ``real`` on a GPU."""
        return str(dry if self.dry else real)


def steps(py: str, work: Path, cache: Path, dry: bool) -> list[Step]:
    """The check's steps, in order of value. ``dry``: the same commands at sizes a CPU finishes quickly.
    ``cache``: the MMFAST_CACHE the steps run with (where ``prepared_photos`` puts the photos)."""
    sizes = Sizes.of(cache, dry)
    return [*_checks(py, work, sizes), *_benchmarks(py, work, sizes), *_batch_256(py, work, sizes)]


def _checks(py: str, work: Path, s: Sizes) -> list[Step]:
    """Does mmfast work on this machine: its versions, NVML, the GPU tests, the README's quickstart."""
    pytest = [py, "-P", "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-o", f"pythonpath={test_paths()}"]
    return [
        Step("environment", [py, "-P", "-c", ENV_SNIPPET], 60),
        Step(
            "nvml",
            [py, "tools/nvml_record.py"] + (["--help"] if s.dry else ["--out", str(work / "nvml.json")]),
            30,
            "raw NVML readings, for the sampler's tests",
        ),
        Step(
            "gpu-tests",
            [*pytest, "-m", "gpu", "--junitxml", str(work / "gpu_tests.xml"), "tests"],
            150,
            "every test marked gpu (skipped without CUDA)",
            ["gpu_tests.xml"],
        ),
        Step(
            "quickstart",
            [py, "tools/train.py", "--out", str(work / "run-quickstart"), "--no-progress"]
            + (["--demo-size", "100", "--epochs", "1", "--batch-size", "16"] if s.dry else []),
            150,
            "the README's training command on its demo set",
            ["run-quickstart/summary.json"],
        ),
    ]


def _benchmarks(py: str, work: Path, s: Sizes) -> list[Step]:
    """The write-up's benchmarks on real photos: the models alone, the loader alone, training end to end."""
    data = ["--data", str(s.photos)]
    return [
        Step(
            "photos",
            [py, "-P", "tools/benchmarks/benchlib/data.py", str(s.n_photos)],
            90,
            "real 800x600 photos (scikit-image's), prepared",
        ),
        Step(
            "models",
            [py, "tools/benchmarks/bench_models.py", *s.model, "--batch-size", s.batch]
            + ["--mixed-precision", "auto", "--steps", s.count(1, 10), "--warmup", s.count(1, 3)]
            + ["--json", str(work / "bench_models.json")],
            90,
            "forward + backward per batch, every fusion model",
            ["bench_models.json"],
        ),
        Step(
            "loader",
            [py, "tools/benchmarks/bench_loader.py", *data, "--size", s.size, "--batch-size", s.batch]
            + ["--rounds", s.count(1, 2), "--epochs", s.count(1, 3), "--json", str(work / "bench_loader.json")],
            150,
            "mmfast loader vs bare DALI vs DataLoader + PIL",
            ["bench_loader.json"],
        ),
        Step(
            "train-bench",
            [py, "tools/benchmarks/bench_train.py", *data, *s.model, "--image-size", s.size]
            + ["--batch-size", s.batch, "--steps", s.count(1, 20), "--warmup", s.count(1, 4)]
            + ["--rounds", "1", "--repeats", "1"]
            + ["--json", str(work / "bench_train.json"), "--png", str(work / "bench_train.png")],
            210,
            "the write-up's claims: DataLoader vs mmfast, fp32 vs fp16; loop overhead",
            ["bench_train.json", "bench_train.png"],
        ),
    ]


def _batch_256(py: str, work: Path, s: Sizes) -> list[Step]:
    """#31: the model step and training at batch 256, then where a step's time goes (with CUDA graphs too)."""
    data, size, batch = ["--data", str(s.photos)], ["--image-size", s.size], ["--batch-size", s.batch]
    return [
        Step(
            "models-256",
            [py, "tools/benchmarks/bench_models.py", *s.model, "--batch-size", s.big_batch]
            + ["--mixed-precision", "auto", "--channels-last", "--steps", s.count(1, 10)]
            + ["--warmup", s.count(1, 3), "--json", str(work / "bench_models_256.json")],
            120,
            "#31: the model step alone at batch 256 (bf16 where the GPU has it, NHWC): what end to end is held to",
            ["bench_models_256.json"],
        ),
        Step(
            "train-256",
            [py, "tools/train.py", *data, *s.model, "--model", "concat", *size, "--batch-size", s.big_batch]
            + ["--epochs", s.count(1, 6), "--no-checkpoints", "--profile", "--out", str(work / "run-256")]
            + ["--no-progress"],
            240,
            "#31: end-to-end training at batch 256 with the hardware defaults (summary: images/s, data wait)",
            ["run-256/summary.json"],
        ),
        Step(
            "profile",
            [py, "tools/profile_run.py", *data, *s.model, *size, *batch]
            + ["--steps", s.count(3, 30), "--warmup", s.count(1, 5)]
            + ["--out", str(work / "profile"), "--no-progress"],
            120,
            "where step time goes, GPU utilization, verdict",
            ["profile/profile.json"],
        ),
        Step(
            "profile-graphs",
            [py, "tools/profile_run.py", *data, *s.model, *size, *batch, "--compile-mode", "reduce-overhead"]
            + ["--steps", s.count(3, 40), "--warmup", s.count(1, 5), "--out", str(work / "profile-graphs")]
            + ["--no-progress"],
            300,
            "#31: the same at batch 64 with CUDA graphs (compiled, captions padded to buckets): GPU busy >= 85%?",
            ["profile-graphs/profile.json"],
        ),
    ]


def install_wheel_parts(parts_dir: Path, log) -> Path:
    """Unpack ``parts_dir/part.*`` (one tar, split) and install its wheels into ``parts_dir/site``."""
    parts = sorted(parts_dir.glob("part.*"))
    if not parts:
        raise SystemExit(f"--wheel-parts {parts_dir}: no part.* files there; copy every part first")
    wheels = parts_dir / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    cat = subprocess.Popen(["cat", *map(str, parts)], stdout=subprocess.PIPE)
    untar = subprocess.run(
        ["tar", "-C", str(wheels), "-xf", "-"], stdin=cat.stdout, capture_output=True, text=True
    )
    cat.stdout.close()
    if cat.wait() != 0 or untar.returncode != 0:
        raise SystemExit(
            f"--wheel-parts {parts_dir}: the parts do not make one tar ({untar.stderr.strip()}); "
            "a part is missing or cut short"
        )
    found = sorted(wheels.rglob("*.whl"))
    site = parts_dir / "site"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--disable-pip-version-check",
        "--upgrade",
        "--target",
        str(site),
        *map(str, found),
    ]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True)
    log(
        f"installed {len(found)} wheels into {site} in {time.perf_counter() - t0:.0f} s: "
        + ", ".join(w.name.split("-")[0] for w in found)
    )
    if res.returncode != 0:
        raise SystemExit(f"pip could not install the wheels from {parts_dir}:\n{res.stderr[-2000:]}")
    return site


def source_tree_copy(dest: Path) -> Path:
    """A copy of this checkout's ``mmfast/`` package in ``dest`` (what ``pip install .`` installs)."""
    shutil.copytree(ROOT / "mmfast", dest / "mmfast", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def run_step(step: Step, env: dict, work: Path, limit: float) -> dict:
    logfile = work / "logs" / f"{step.name}.log"
    t0 = time.perf_counter()
    with open(logfile, "w") as f:
        try:
            rc = subprocess.run(
                step.argv,
                cwd=ROOT,
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=limit,
                start_new_session=True,
            ).returncode
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            rc, status = None, "timeout"
    seconds = time.perf_counter() - t0
    missing = [o for o in step.outputs if not (work / o).exists()]
    if status == "ok" and missing:
        status = "failed"
    tail = logfile.read_text(errors="replace").splitlines()[-15:]
    return {
        "name": step.name,
        "status": status,
        "rc": rc,
        "seconds": round(seconds, 1),
        "limit_s": round(limit),
        "note": step.note,
        "missing_outputs": missing,
        "tail": tail,
    }


def step_results(work: Path) -> dict:
    """The JSON the steps wrote in ``work``, under the summary's keys (a step that wrote none has none)."""
    found: dict = {}
    for name in ("bench_models", "bench_models_256", "bench_loader", "bench_train", "nvml"):
        f = work / f"{name}.json"
        if f.exists():
            try:
                found[name] = json.loads(f.read_text())
            except json.JSONDecodeError as e:
                found[name] = {"error": f"unreadable: {e}"}
    if (run_256 := work / "run-256" / "summary.json").exists():  # #31's end-to-end figures
        found["train_256"] = json.loads(run_256.read_text())
    for name in ("profile", "profile-graphs"):
        if (prof := work / name / "profile.json").exists():
            found[name.replace("-", "_")] = json.loads(prof.read_text())
    return found


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu_out", help="folder for summary.json, log.txt and gpu_check.tar.gz")
    p.add_argument("--budget", type=float, default=420, help="seconds for all steps together")
    p.add_argument("--wheel-parts", type=Path, help="folder of part.* files: a split tar of wheels to install")
    p.add_argument("--only", nargs="*", help="run only these steps")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes, CPU allowed: checks the plumbing")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = out / "gpu_check"
    shutil.rmtree(work, ignore_errors=True)
    (work / "logs").mkdir(parents=True)
    lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    scratch = Path(tempfile.mkdtemp(prefix="mmfast-gpucheck-"))
    paths = [str(source_tree_copy(scratch / "src")), str(ROOT)]  # tests import tools/ and conftest from ROOT
    if args.wheel_parts:
        paths.insert(1, str(install_wheel_parts(args.wheel_parts.resolve(), log)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    env["MMFAST_CACHE"] = str(scratch / "cache")  # the photos and the demo set: fresh, off the user's cache
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")

    plan = steps(sys.executable, work, scratch / "cache", args.dry_run)
    if args.only:
        unknown = set(args.only) - {s.name for s in plan}
        if unknown:
            raise SystemExit(f"--only: unknown step(s) {sorted(unknown)}; steps: {[s.name for s in plan]}")
        plan = [s for s in plan if s.name in args.only]
    results = []
    for step in plan:
        left = args.budget - (time.perf_counter() - t_start) - PACK_RESERVE_S
        if left < 15:
            results.append({"name": step.name, "status": "skipped", "note": "budget spent"})
            log(f"== {step.name}: skipped, budget spent")
            continue
        # a dry run's CPU is slower than any GPU, and a shared CI machine slower still
        limit = min(step.timeout * (3 if args.dry_run else 1), left)
        log(f"== {step.name} ({step.note or 'versions and GPU'}), at most {limit:.0f} s")
        res = run_step(step, env, work, limit)
        results.append(res)
        log(
            f"   {res['status']} in {res['seconds']} s"
            + (f", missing {res['missing_outputs']}" if res.get("missing_outputs") else "")
        )
        if res["status"] != "ok" or step.name in ("environment", "quickstart"):
            for line in res["tail"]:
                log("   | " + line)

    summary = {
        "dry_run": args.dry_run,
        "seconds": round(time.perf_counter() - t_start, 1),
        "budget_s": args.budget,
        "steps": results,
    }
    summary.update(step_results(work))
    log("\n" + f"{'step':<14}{'status':<9}{'seconds':>8}")
    for r in results:
        log(f"{r['name']:<14}{r['status']:<9}{r.get('seconds', 0):>8}")
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "log.txt").write_text("\n".join(lines) + "\n")
    with tarfile.open(out / "gpu_check.tar.gz", "w:gz") as tar:
        tar.add(
            work,
            arcname="gpu_check",
            filter=lambda ti: None if ti.name.endswith((".pt", ".safetensors", ".bin")) else ti,
        )
    shutil.rmtree(work)
    shutil.rmtree(scratch, ignore_errors=True)
    failed = [r["name"] for r in results if r["status"] not in ("ok", "skipped")]
    print(f"wrote {out}/summary.json, log.txt, gpu_check.tar.gz" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
