"""Build the lab's tokenizer, tiny target and draft ladder, offline and deterministically.

The ladder straddles the 0.4 acceptance threshold the controller cares about:

- ``good``   the target with a little calibrated weight noise (greedy agreement ~0.96),
- ``medium`` more noise (agreement ~0.75),
- ``weak``   more still (agreement ~0.25: acceptance clearly below 0.4),
- ``random`` an untrained model of a small shape (agreement ~0),
- ``copy``   an exact copy of the target (agreement 1.0),
- ``ngram``  prompt lookup (no weights).

The graded drafts share the target's shape, so they cost the same per step and the ladder varies
quality alone; on 2 CPU cores distilling a small draft to ~0.95 agreement costs more build time than a
test suite can spend (a 0.53 M-parameter draft reached 0.61 in 160 steps). Noise is calibrated by
bisection on measured agreement, so the bands hold on any machine.
A second call with the same recipe finds ``manifest.json`` and returns at once.

Two recipes:

- ``tiny`` (default, ``.lab/models``): the models above as trained, 3 M parameters each; fast engines
  for the functional tests, but the per-step overhead dominates and every draft costs what the target
  costs, so speculation's trade-off is not a GPU's.
- ``gpu-like`` (``.lab/gpu-models``): the same trained models carried inside larger shells
  (``tuner.lab.widen``): a 136 M-parameter target (8 layers, hidden 1024, MLP 4096) and 21 M-parameter
  drafts (4 layers, hidden 640), so the target's forward pass dominates each step, a graded draft
  costs ~0.13 of it at batch 1, and verifying K + 1 tokens per sequence gets expensive under load:
  speculation wins ~2× at 1 stream and loses at 32-64 streams, as on GPUs. The texts and agreements
  are the small models' (the shells compute the same logits). ``docs/lab.md`` has the measured figures.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tuner.lab import corpus as corpus_mod

if TYPE_CHECKING:  # torch and transformers come with the engine extras only
    import torch

log = logging.getLogger(__name__)

BUILDER_VERSION = 4
MANIFEST = "manifest.json"
DEFAULT_MODELS_DIR = Path(".lab/models")
GPU_LIKE_MODELS_DIR = Path(".lab/gpu-models")
# token counts the builder times each saved model at (direct torch timing, batch 1 × n tokens)
TIMED_TOKENS = (1, 4, 16, 64)


@dataclass(frozen=True)
class Shape:
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int


@dataclass(frozen=True)
class Recipe:
    """Everything that determines the built models; its hash keys the cache."""

    seed: int = 0
    vocab_size: int = 800
    n_docs: int = 4000
    seq_len: int = 64
    max_position_embeddings: int = 512
    target: Shape = Shape(256, 4, 4, 512)
    draft: Shape = Shape(128, 2, 2, 256)
    target_steps: int = 180
    batch_size: int = 16
    lr: float = 5e-3
    eval_prompts: int = 24
    eval_new_tokens: int = 40
    good_agreement: float = 0.96
    medium_agreement: float = 0.75
    weak_agreement: float = 0.25
    agreement_tolerance: float = 0.04
    name: str = "tiny"
    # shells the trained models are carried in (None: saved as trained); see tuner.lab.widen
    target_shell: Shape | None = None
    draft_shell: Shape | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Recipe:
        """The recipe a manifest recorded (``asdict`` form)."""
        shapes = ("target", "draft", "target_shell", "draft_shell")
        kw: dict[str, Any] = {k: (Shape(**v) if k in shapes and isinstance(v, dict) else v) for k, v in data.items()}
        return cls(**{k: v for k, v in kw.items() if k in cls.__dataclass_fields__})

    def key(self) -> str:
        blob = json.dumps({"builder": BUILDER_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


GPU_LIKE = Recipe(
    name="gpu-like",
    target_shell=Shape(1024, 8, 16, 4096),
    draft_shell=Shape(640, 4, 10, 1536),
    # a good draft of a GPU deployment accepts ~0.85-0.9 per token: good sits just above the 0.9 band
    # edge (at 0.935 it accepted 0.90 in vLLM and good/K=3 came within 7 % of no speculation at 64 streams)
    good_agreement=0.915,
    medium_agreement=0.72,
    agreement_tolerance=0.02,
)
RECIPES: dict[str, Recipe] = {"tiny": Recipe(), "gpu-like": GPU_LIKE}


@dataclass
class ModelInfo:
    name: str
    path: str
    method: str = "draft_model"
    params: int = 0
    dtype: str = "float32"
    weight_bytes: int = 0
    kv_bytes_per_token: int = 0
    num_layers: int = 0
    hidden_size: int = 0
    greedy_agreement: float | None = None
    notes: str = ""
    # one forward pass over n tokens, ms (torch eager on this machine at build time), keyed by n
    step_ms: dict[str, float] = field(default_factory=dict)
    # this model's 1-token forward ÷ the target's (a draft's cost c at batch 1); None: not timed
    cost_ratio: float | None = None


@dataclass
class Manifest:
    build_key: str
    builder_version: int
    tokenizer_path: str
    target: ModelInfo
    drafts: dict[str, ModelInfo]
    build_seconds: float
    recipe: dict[str, Any] = field(default_factory=dict)
    # written by `spectuner lab calibrate` (measured in the vLLM engine); None until then
    calibration: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "build_key": self.build_key,
            "builder_version": self.builder_version,
            "tokenizer_path": self.tokenizer_path,
            "target": asdict(self.target),
            "drafts": {k: asdict(v) for k, v in self.drafts.items()},
            "build_seconds": self.build_seconds,
            "recipe": self.recipe,
            "calibration": self.calibration,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Manifest:
        return cls(
            build_key=data["build_key"],
            builder_version=data["builder_version"],
            tokenizer_path=data["tokenizer_path"],
            target=ModelInfo(**data["target"]),
            drafts={k: ModelInfo(**v) for k, v in data["drafts"].items()},
            build_seconds=data["build_seconds"],
            recipe=data.get("recipe", {}),
            calibration=data.get("calibration"),
        )


class LabModelsMissing(RuntimeError):
    """The lab models are not built (or were built by another recipe)."""


def load_manifest(models_dir: Path) -> Manifest:
    path = Path(models_dir) / MANIFEST
    if not path.exists():
        raise LabModelsMissing(
            f"no lab models in {models_dir}: run `spectuner lab build-models {models_dir}` first"
        )
    return Manifest.from_json(json.loads(path.read_text()))


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int = 4) -> int:
    """layers × 2 (K and V) × kv_heads × head_dim × dtype bytes, from a HF ``config.json``."""
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    return int(config["num_hidden_layers"]) * 2 * kv_heads * head_dim * dtype_bytes


def build_models(models_dir: Path, recipe: Recipe | None = None, force: bool = False) -> Manifest:
    """Build (or find cached) lab models in ``models_dir``; returns the manifest.

    Without a ``recipe``, a directory keeps the recipe it was built with (``tiny`` when new)."""
    models_dir = Path(models_dir)
    cached: Manifest | None
    try:
        cached = load_manifest(models_dir)
    except LabModelsMissing:
        cached = None
    if recipe is None:
        recipe = Recipe.from_json(cached.recipe) if cached and cached.recipe else Recipe()
    if not force and cached and cached.build_key == recipe.key() and _all_present(cached):
        return cached
    return _Builder(models_dir, recipe).build()


def _all_present(m: Manifest) -> bool:
    paths = [m.tokenizer_path, m.target.path] + [d.path for d in m.drafts.values() if d.path]
    return all((Path(p) / "config.json").exists() or Path(p, "tokenizer.json").exists() for p in paths)


class _Builder:
    def __init__(self, models_dir: Path, recipe: Recipe) -> None:
        self.dir = models_dir.resolve()
        self.r = recipe

    def build(self) -> Manifest:
        import torch

        t0 = time.monotonic()
        torch.manual_seed(self.r.seed)
        torch.use_deterministic_algorithms(True, warn_only=True)
        tmp = self.dir.with_name(self.dir.name + ".building")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)

        log.info("lab (%s): training the tokenizer", self.r.name)
        tok = self._tokenizer(tmp / "tokenizer")
        data = self._encode(tok)
        log.info("lab (%s): training the target, %d steps", self.r.name, self.r.target_steps)
        target = self._train_target(data, len(tok))
        prompts, sequences, gen_mask = self._eval_set(tok, target)

        drafts: dict[str, Any] = {}
        for name, want in (("good", self.r.good_agreement), ("medium", self.r.medium_agreement),
                           ("weak", self.r.weak_agreement)):
            log.info("lab (%s): calibrating draft %r to greedy agreement %.2f", self.r.name, name, want)
            drafts[name] = self._calibrated_noise(target, sequences, gen_mask, target, want)
        drafts["random"] = self._new_model(self.r.draft, len(tok), seed=self.r.seed + 99)
        drafts["copy"] = target
        # Agreement is measured on the trained models: a shell computes the same logits.
        agreement = {n: round(self._agreement(m, target, sequences, gen_mask), 4) for n, m in drafts.items()}

        final_tok = self.dir / "tokenizer"
        infos: dict[str, ModelInfo] = {}
        big_target = self._shell(target, self.r.target_shell, "target")
        target_info = self._save(big_target, tok, tmp / "target", "target", self.dir / "target")
        # Cost depends on the shape only: time each distinct shape once, so the graded drafts
        # (one shell) carry one figure, not four noisy ones.
        timed: dict[tuple[int, ...], dict[str, float]] = {}
        target_info.step_ms = _timed_by_shape(big_target, timed)
        target_info.cost_ratio = 1.0
        for name, model in drafts.items():
            big = big_target if name == "copy" else self._shell(model, self.r.draft_shell, f"draft {name!r}")
            info = self._save(big, tok, tmp / f"draft-{name}", name, self.dir / f"draft-{name}")
            info.greedy_agreement = agreement[name]
            info.step_ms = _timed_by_shape(big, timed)
            info.cost_ratio = round(info.step_ms["1"] / target_info.step_ms["1"], 3)
            infos[name] = info
        infos["ngram"] = ModelInfo(name="ngram", path="", method="ngram", notes="prompt lookup; no weights")

        manifest = Manifest(
            build_key=self.r.key(),
            builder_version=BUILDER_VERSION,
            tokenizer_path=str(final_tok),
            target=target_info,
            drafts=infos,
            build_seconds=round(time.monotonic() - t0, 1),
            recipe=asdict(self.r),
        )
        (tmp / MANIFEST).write_text(json.dumps(manifest.to_json(), indent=2) + "\n")
        (tmp / "eval_prompts.json").write_text(json.dumps(prompts) + "\n")
        # Swap in atomically-ish: a half-built directory never carries a manifest.
        shutil.rmtree(self.dir, ignore_errors=True)
        tmp.rename(self.dir)
        log.info("lab (%s): built in %.0f s: %s", self.r.name, manifest.build_seconds, self.dir)
        return manifest

    def _shell(self, model: Any, shape: Shape | None, what: str) -> Any:
        if shape is None:
            return model
        from tuner.lab.widen import ShellShape, widen

        log.info("lab (%s): carrying the %s in a %s shell", self.r.name, what, shape)
        return widen(model, ShellShape(shape.hidden_size, shape.num_layers, shape.num_heads,
                                       shape.intermediate_size), seed=self.r.seed + 7)

    # -- tokenizer and data -------------------------------------------------------------------------
    def _tokenizer(self, out: Path) -> Any:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        tk = Tokenizer(models.BPE())
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tk.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=self.r.vocab_size,
            special_tokens=["<pad>", "<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tk.train_from_iterator(corpus_mod.corpus(self.r.seed + 1, 3000), trainer=trainer)
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
        )
        fast.chat_template = (
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}"
        )
        fast.model_max_length = self.r.max_position_embeddings
        fast.save_pretrained(out)
        return fast

    def _encode(self, tok: Any) -> torch.Tensor:
        import torch

        ids: list[int] = []
        for doc in corpus_mod.corpus(self.r.seed, self.r.n_docs):
            ids.append(tok.bos_token_id)
            ids.extend(tok.encode(doc, add_special_tokens=False))
            ids.append(tok.eos_token_id)
        n = len(ids) // self.r.seq_len
        return torch.tensor(ids[: n * self.r.seq_len]).view(n, self.r.seq_len)

    # -- models -------------------------------------------------------------------------------------
    def _new_model(self, shape: Shape, vocab: int, seed: int) -> Any:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(seed)
        cfg = LlamaConfig(
            vocab_size=vocab,
            hidden_size=shape.hidden_size,
            intermediate_size=shape.intermediate_size,
            num_hidden_layers=shape.num_layers,
            num_attention_heads=shape.num_heads,
            num_key_value_heads=shape.num_heads,
            max_position_embeddings=self.r.max_position_embeddings,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            tie_word_embeddings=False,
            dtype="float32",
        )
        return LlamaForCausalLM(cfg)

    def _batches(self, data: torch.Tensor, steps: int, seed: int) -> Any:
        import torch

        g = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            idx = torch.randint(0, data.shape[0], (self.r.batch_size,), generator=g)
            yield data[idx]

    def _optim(self, model: Any, steps: int) -> tuple[Any, Any]:
        import torch

        opt = torch.optim.AdamW(model.parameters(), lr=self.r.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.r.lr, total_steps=steps, pct_start=0.1)
        return opt, sched

    def _train_target(self, data: torch.Tensor, vocab: int) -> Any:
        model = self._new_model(self.r.target, vocab, seed=self.r.seed)
        model.train()
        opt, sched = self._optim(model, self.r.target_steps)
        for i, batch in enumerate(self._batches(data, self.r.target_steps, self.r.seed + 10)):
            loss = model(input_ids=batch, labels=batch).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            if i % 20 == 0 or i == self.r.target_steps - 1:
                log.info("target step %d/%d loss %.3f", i, self.r.target_steps, loss.item())
        model.eval()
        return model

    # -- agreement ----------------------------------------------------------------------------------
    def _eval_set(self, tok: Any, target: Any) -> tuple[list[str], torch.Tensor, torch.Tensor]:
        """Target-greedy continuations of a mix of predictable and hard prompts.

        Agreement on the target's own greedy text is what greedy speculative decoding accepts.
        """
        import torch

        half = self.r.eval_prompts // 2
        prompts = corpus_mod.predictable_prompts(seed=101, n=half) + corpus_mod.hard_prompts(seed=103, n=half)
        seqs, masks = [], []
        for p in prompts:
            ids = torch.tensor([[tok.bos_token_id, *tok.encode(p, add_special_tokens=False)]])
            with torch.no_grad():
                out = target.generate(
                    ids, max_new_tokens=self.r.eval_new_tokens, min_new_tokens=self.r.eval_new_tokens,
                    do_sample=False, pad_token_id=0,
                )
            seq = out[0]
            mask = torch.zeros_like(seq, dtype=torch.bool)
            mask[ids.shape[1] - 1 : -1] = True  # positions whose next-token prediction is generated text
            seqs.append(seq)
            masks.append(mask)
        width = max(len(s) for s in seqs)
        pad = torch.zeros(len(seqs), width, dtype=torch.long)
        m = torch.zeros(len(seqs), width, dtype=torch.bool)
        for i, (s, mk) in enumerate(zip(seqs, masks, strict=True)):
            pad[i, : len(s)] = s
            m[i, : len(mk)] = mk
        return prompts, pad, m

    def _agreement(self, model: Any, target: Any, seqs: torch.Tensor, mask: torch.Tensor) -> float:
        import torch

        with torch.no_grad():
            a = model(input_ids=seqs).logits.argmax(-1)
            b = target(input_ids=seqs).logits.argmax(-1)
        return float((a == b)[mask].float().mean())

    def _calibrated_noise(
        self, base: Any, seqs: torch.Tensor, mask: torch.Tensor, target: Any, want: float
    ) -> Any:
        """``base`` plus scale × std × fixed Gaussian noise, the scale bisected to reach ``want``."""
        import copy

        import torch

        g = torch.Generator().manual_seed(self.r.seed + int(want * 1000))
        noise = {n: torch.randn(p.shape, generator=g) for n, p in base.named_parameters()}
        lo, hi = 0.0, 4.0
        best, best_gap = base, 1.0
        for _ in range(20):
            scale = (lo + hi) / 2
            cand = copy.deepcopy(base)
            with torch.no_grad():
                for n, p in cand.named_parameters():
                    p.add_(noise[n] * p.std() * scale)
            agree = self._agreement(cand, target, seqs, mask)
            if abs(agree - want) < best_gap:
                best, best_gap = cand, abs(agree - want)
            if best_gap <= self.r.agreement_tolerance / 2:
                break
            if agree > want:
                lo = scale
            else:
                hi = scale
        return best

    # -- output -------------------------------------------------------------------------------------
    def _save(self, model: Any, tok: Any, tmp_out: Path, name: str, final: Path) -> ModelInfo:
        model.save_pretrained(tmp_out, safe_serialization=True)
        tok.save_pretrained(tmp_out)
        cfg = json.loads((tmp_out / "config.json").read_text())
        params = sum(p.numel() for p in model.parameters())
        return ModelInfo(
            name=name,
            path=str(final),
            params=int(params),
            weight_bytes=int(params) * 4,
            kv_bytes_per_token=kv_bytes_per_token(cfg),
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=int(cfg["hidden_size"]),
            greedy_agreement=1.0 if name == "target" else None,
        )


def _timed_by_shape(model: Any, cache: dict[tuple[int, ...], dict[str, float]]) -> dict[str, float]:
    c = model.config
    key = (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.intermediate_size, c.vocab_size)
    if key not in cache:
        cache[key] = _step_ms(model)
    return cache[key]


def _step_ms(model: Any, tokens: tuple[int, ...] = TIMED_TOKENS, repeats: int = 5) -> dict[str, float]:
    """Fastest wall time of one forward pass over n tokens (batch 1), ms: direct timing, for the manifest.

    The minimum, not the median: another process on the machine only ever adds time, so the
    fastest of a few repeats is the least disturbed estimate of the model's own cost.
    """
    import torch

    out: dict[str, float] = {}
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n in tokens:
            ids = torch.randint(3, int(model.config.vocab_size), (1, n), generator=g)
            model(input_ids=ids)  # warm
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                model(input_ids=ids)
                times.append((time.perf_counter() - t) * 1000)
            out[str(n)] = round(min(times), 2)
    return out
