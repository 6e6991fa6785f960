"""The LlamaFineTune spec: the one definition of every field users write.

`crds/` is generated from these classes, the operator and `llamaft validate` check input with
them, and the trainer reads `TrainingJobConfig` (model, dataset, training, fsdp, checkpointing)
from the same classes. Cross-field rules are CEL expressions attached with `api_config(...)`; they
go into the CRD unchanged and are evaluated by the CLI with the same text.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from llamaft.api.base import ApiEnum, ApiModel, api_config, cel_rule

QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"
POSITIVE_QUANTITY_PATTERN = r"^([0-9]*[1-9][0-9]*(\.[0-9]+)?|[0-9]+\.[0-9]*[1-9][0-9]*)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"
"""A Kubernetes quantity greater than zero (a size or CPU count of 0 makes the pod unschedulable or useless)."""
NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
"""A DNS-1123 label (at most 63 characters)."""
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
"""A DNS-1123 subdomain (at most 253 characters): names of claims, Secrets, PriorityClasses."""
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
"""A label value (at most 63 characters)."""
LABEL_KEY_PATTERN = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
"""A label key: an optional DNS-subdomain prefix and '/', then a name of at most 63 characters."""
NO_WHITESPACE_PATTERN = r"^[^ \t\n\r\f\v]+$"
PORT_PATTERN = r"([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])"
"""1..65535."""
INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1
MAX_WORLD_SIZE = 65536
"""Most training processes one job may have (workers x GPUs per worker)."""
LabelValue = Annotated[str, Field(max_length=63, pattern=LABEL_VALUE_PATTERN)]


def _cel_string(text: str) -> str:
    """`text` inside a single-quoted CEL string literal (a regex's backslashes doubled)."""
    return text.replace("\\", "\\\\").replace("'", "\\'")


def pvc_source_rule(field: str, optional: bool = False) -> dict[str, Any]:
    """`pvc://<claim>/<path>`: the claim must be a PersistentVolumeClaim name (it becomes a volume)."""
    claim = _cel_string(r"^pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*(/.*)?$")
    check = (
        f"!self.{field}.startsWith('pvc://') || (self.{field}.matches('{claim}') && "
        f"!self.{field}.matches('^pvc://[^/]{{254,}}'))"
    )
    return cel_rule(
        f"!has(self.{field}) || {check}" if optional else check,
        message="pvc:// sources look like pvc://<claim>/<path>, with <claim> the name of a "
        "PersistentVolumeClaim in this namespace (lowercase letters, digits, '-' and '.'), e.g. pvc://models/llama-2-7b",
        field_path=f".{field}",
    )


# --------------------------------------------------------------------------------------- model
class ModelDtype(ApiEnum):
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"


class AttentionImplementation(ApiEnum):
    SDPA = "sdpa"
    EAGER = "eager"
    FLASH_ATTENTION_2 = "flash_attention_2"


class SecretKeyRef(ApiModel):
    """A key of a Secret in the CR's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
    """Name of the Secret."""
    key: str = Field(default="token", min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")
    """Key inside the Secret whose value is used."""


IMMUTABLE_SOURCE = cel_rule(
    "self.source == oldSelf.source",
    message="model.source is immutable: a run's checkpoints belong to its model; create a new LlamaFineTune",
    field_path=".source",
    reason="FieldValueForbidden",
)
IMMUTABLE_CHECKPOINTS = cel_rule(
    "self.directory == oldSelf.directory",
    message="checkpointing.directory is immutable: changing it would orphan the run's progress; create a new LlamaFineTune",
    field_path=".directory",
    reason="FieldValueForbidden",
)


class ModelSpec(ApiModel):
    """Which pretrained Llama-shaped model to fine-tune and how to load it."""

    model_config = api_config(IMMUTABLE_SOURCE, pvc_source_rule("source"), pvc_source_rule("tokenizer", optional=True))

    source: str = Field(min_length=1, max_length=1024)
    """Where the pretrained weights are: a Hugging Face hub id (`meta-llama/Llama-2-7b-hf`),
    `pvc://<claim>/<path>` (the operator mounts the claim read-only), an absolute or relative
    local path, or an fsspec URI (`s3://bucket/prefix`)."""
    revision: str | None = Field(default=None, max_length=256)
    """Hub revision (branch, tag or commit) when `source` is a hub id."""
    tokenizer: str | None = Field(default=None, max_length=1024)
    """Tokenizer location when it differs from `source` (same forms as `source`)."""
    hf_token_secret: SecretKeyRef | None = None
    """Secret holding a Hugging Face token for gated models; never put the token in the spec."""
    dtype: ModelDtype = ModelDtype.BFLOAT16
    """dtype the weights are loaded in before FSDP's mixed-precision policy applies."""
    attn_implementation: AttentionImplementation = AttentionImplementation.SDPA
    """Attention kernel passed to transformers (`sdpa` works everywhere)."""


# ------------------------------------------------------------------------------------- dataset
class DatasetFormat(ApiEnum):
    SAMSUM = "samsum"
    ALPACA = "alpaca"
    JSONL = "jsonl"
    CHAT = "chat"
    PREFERENCE = "preference"


class TrainOn(ApiEnum):
    """Which tokens of a `chat` record carry loss."""

    ASSISTANT = "assistant"
    LAST_ASSISTANT = "lastAssistant"
    ALL = "all"


class PackingStrategy(ApiEnum):
    """How `packing` fills each `maxSeqLength` sequence."""

    BFD = "bfd"
    CONCATENATE = "concatenate"


BUILTIN_CHAT_TEMPLATES = ("llama3", "llama2")
"""Names `dataset.chatTemplate` may give instead of a Jinja template (llamaft_trainer.data.chat)."""


class FieldMapping(ApiModel):
    """Which record fields hold the prompt parts and the response (`jsonl` format), the
    conversation (`chat`), or the prompt and the two completions (`preference`)."""

    prompt: list[str] = Field(default_factory=list, max_length=16)
    """Fields placed in the prompt, in order, when no promptTemplate is given (default: the
    format's own fields). `preference` format: at most one, the field holding the prompt
    (default `prompt`)."""
    response: str | None = Field(default=None, min_length=1, max_length=128)
    """Field whose text the model learns to produce; only these tokens carry loss (default:
    `summary` for samsum, `output` for alpaca and jsonl)."""
    messages: str = Field(default="messages", min_length=1, max_length=128)
    """`chat` format: the field holding the conversation, a list of `{role, content}` turns
    (roles `system`, `user`, `assistant`)."""
    chosen: str = Field(default="chosen", min_length=1, max_length=128)
    """`preference` format: the field holding the preferred completion (a string, or a list of
    `{role, content}` turns when the prompt is one)."""
    rejected: str = Field(default="rejected", min_length=1, max_length=128)
    """`preference` format: the field holding the dispreferred completion (same form as chosen)."""


class DatasetSpec(ApiModel):
    """The training data and how each record becomes tokens."""

    model_config = api_config(
        cel_rule(
            "self.format != 'jsonl' || has(self.promptTemplate) || size(self.fieldMapping.prompt) > 0",
            message="format jsonl needs promptTemplate (e.g. '{question}\\n') or fieldMapping.prompt",
            field_path=".promptTemplate",
            reason="FieldValueRequired",
        ),
        cel_rule(
            "self.format == 'chat' || ((self.format == 'preference' || !has(self.chatTemplate)) && !has(self.trainOn))",
            message="chatTemplate and trainOn apply to format chat only (chatTemplate also to format preference): "
            "set format: chat or remove them",
            field_path=".format",
            reason="FieldValueInvalid",
        ),
        cel_rule(
            "self.format != 'preference' || !has(self.promptTemplate)",
            message="format preference tokenizes each record's prompt, chosen and rejected as they are (TRL's "
            "preference format), not through promptTemplate: remove promptTemplate",
            field_path=".promptTemplate",
            reason="FieldValueInvalid",
        ),
        cel_rule(
            "self.format != 'preference' || size(self.fieldMapping.prompt) <= 1",
            message="format preference reads the prompt from one field: give fieldMapping.prompt one name, "
            "e.g. [question] (default prompt)",
            field_path=".fieldMapping.prompt",
        ),
        cel_rule(
            "self.format != 'chat' || !has(self.promptTemplate)",
            message="format chat renders turns with the tokenizer's chat template (or chatTemplate), not promptTemplate: "
            "remove promptTemplate",
            field_path=".promptTemplate",
            reason="FieldValueInvalid",
        ),
        pvc_source_rule("source"),
    )

    format: DatasetFormat
    """`samsum` (dialogue -> summary), `alpaca` (instruction/input/output), `jsonl` (a prompt
    template over record fields), `chat` (a list of system/user/assistant turns per record,
    rendered with the tokenizer's chat template) or `preference` (a prompt, a chosen and a
    rejected completion per record, each a string or a list of turns, for training.method dpo;
    tokenized as TRL's DPOTrainer does)."""
    source: str = Field(min_length=1, max_length=1024)
    """A hub dataset id (read with `datasets`: JSON Lines, Parquet, CSV or Arrow files), a local
    path, `pvc://<claim>/<path>` or an fsspec URI to a JSON Lines file."""
    revision: str | None = Field(default=None, min_length=1, max_length=256)
    """Hub revision (branch, tag or commit) when `source` is a hub dataset: pin a commit for a
    reproducible run."""
    split: str = Field(default="train", min_length=1, max_length=64)
    """Split to read when `source` is a hub dataset."""
    chat_template: str | None = Field(default=None, min_length=1, max_length=65536)
    """`chat` format (and `preference` records made of turns): a Jinja chat template, or a
    built-in one by name (`llama3`, `llama2`), used when the tokenizer has none or to override its
    own (default: the tokenizer's template)."""
    train_on: TrainOn | None = None
    """`chat` format: which tokens carry loss: `assistant` (every assistant turn, the default),
    `lastAssistant` (the final assistant turn only) or `all` (the whole conversation)."""
    streaming: bool = False
    """Tokenize while training instead of preparing the whole set first (for sets too large to
    prepare up front): records are read in file order, shuffled within a bounded buffer, and a
    resumed run continues at the exact record it stopped at."""
    prompt_template: str | None = Field(default=None, min_length=1, max_length=4096)
    """Python format string over record fields (e.g. `Summarize:\\n{dialogue}\\nSummary: `).
    Overrides the format's built-in template."""
    field_mapping: FieldMapping = Field(default_factory=FieldMapping)
    """Record fields for the prompt and response (defaults suit each built-in format)."""
    max_seq_length: int = Field(default=2048, ge=16, le=131072)
    """Tokens per training sequence; must not exceed the model's max_position_embeddings."""
    packing: bool = False
    """Pack several examples into each sequence (no padding waste) instead of padding each one
    (not with training.method dpo: a pair is never packed)."""
    packing_strategy: PackingStrategy = PackingStrategy.BFD
    """With `packing`: `bfd` places whole examples into sequences by best-fit decreasing (TRL's
    default) and each example attends only to itself (position ids restart per example, no label
    crosses an example boundary), so a packed example's loss and gradients are those it has alone.
    `concatenate` cuts the examples laid back to back into full sequences, each attending to the
    ones before it in its sequence (cross-talk): for continued pre-training on raw text, where that
    is wanted. Evaluation packs by `bfd` with either, so the eval loss does not depend on packing."""
    validation_split: float = Field(default=0.05, ge=0.0, le=0.5)
    """Fraction of records held out for eval loss and perplexity (0 disables eval)."""


# ------------------------------------------------------------------------------------ training
class SchedulerType(ApiEnum):
    COSINE = "cosine"
    LINEAR = "linear"
    CONSTANT = "constant"


class LoraExport(ApiEnum):
    ADAPTER = "adapter"
    MERGED = "merged"
    BOTH = "both"


class LoraSpec(ApiModel):
    """Low-rank adapters (peft); the base weights stay frozen."""

    model_config = api_config(
        cel_rule(
            "!self.enabled || size(self.targetModules) > 0",
            message="LoRA is enabled but targetModules is empty: name at least one module, e.g. [q_proj, v_proj]",
            field_path=".targetModules",
            reason="FieldValueRequired",
        ),
        cel_rule(
            "!self.useDora || self.targetModules.all(m, m != 'embed_tokens' && !m.endsWith('.embed_tokens'))",
            message="useDora applies to linear layers only: remove embed_tokens from targetModules "
            "(a DoRA magnitude of an embedding is a norm over every row, which no rank holds)",
            field_path=".targetModules",
        ),
    )

    enabled: bool = True
    """Train LoRA adapters instead of every weight."""
    r: int = Field(default=8, ge=1, le=1024)
    """Adapter rank."""
    alpha: int = Field(default=16, ge=1, le=4096)
    """Scaling numerator (effective scale alpha / r)."""
    dropout: float = Field(default=0.05, ge=0.0, lt=1.0)
    """Dropout on the adapter input."""
    target_modules: list[Annotated[str, Field(min_length=1, max_length=128)]] = Field(
        default_factory=lambda: ["q_proj", "v_proj"], max_length=32
    )
    """Module names that get adapters (Llama: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)."""
    use_dora: bool = False
    """DoRA (peft `use_dora`): each adapted linear layer also learns a magnitude per output row,
    initialised to the row norms of the pretrained weight, and the adapter moves only the
    direction. One more trainable vector per layer; each forward recomputes the weight norm (a
    weight-sized temporary per adapted layer). Linear layers only (not embed_tokens)."""
    export: LoraExport = LoraExport.ADAPTER
    """What the final export writes: `adapter` (peft's adapter files, for a base model you load
    beside it), `merged` (the adapter merged into the base weights, in model.dtype: a plain model
    any serving stack loads), or `both` (the merged model, the adapter in its `adapter/` folder)."""


class TrainingMethod(ApiEnum):
    """What the model learns from the data."""

    SFT = "sft"
    DPO = "dpo"


class DpoLoss(ApiEnum):
    """TRL's DPOTrainer loss types (`DPOConfig.loss_type`) llamaft implements."""

    SIGMOID = "sigmoid"
    IPO = "ipo"


class DpoReference(ApiEnum):
    """How full fine-tuning gets the reference model's log-probabilities."""

    PRECOMPUTED = "precomputed"
    LIVE = "live"


class DpoSpec(ApiModel):
    """Direct preference optimisation (DPO, or IPO) on pairs of a chosen and a rejected completion,
    with TRL's DPOTrainer's definitions: the policy learns to raise the chosen completion's
    log-probability relative to a frozen reference model more than the rejected one's."""

    beta: float = Field(default=0.1, gt=0.0, le=1000.0)
    """How far the policy may move from the reference (TRL's `beta`): the temperature of the
    sigmoid loss, the regularisation strength tau of IPO (larger keeps closer to the reference)."""
    loss: DpoLoss = DpoLoss.SIGMOID
    """`sigmoid` (DPO: -log sigmoid(beta x the margin of the log-ratios)) or `ipo` (the squared
    distance of the per-token log-ratio margin from 1/(2 beta), TRL's length-normalised IPO)."""
    reference: DpoReference = DpoReference.PRECOMPUTED
    """Full fine-tuning: `precomputed` (one pass of the initial model over the data before
    training, stored with the token store, so no second model occupies GPU memory) or `live` (a
    frozen sharded copy of the initial model runs beside the policy). With LoRA the reference is
    the base model with the adapters disabled, whatever this says: no copy at all."""


class TrainingSpec(ApiModel):
    """Optimisation: how long, how fast, how reproducible."""

    model_config = api_config(
        cel_rule(
            "has(self.epochs) != has(self.maxSteps)",
            message="set exactly one of epochs or maxSteps (e.g. epochs: 3)",
            reason="FieldValueInvalid",
        ),
        cel_rule(
            "!has(self.maxSteps) || self.warmupSteps <= self.maxSteps",
            message="warmupSteps exceeds maxSteps: the learning rate would never reach learningRate; lower warmupSteps",
            field_path=".warmupSteps",
        ),
        cel_rule(
            "!has(self.globalBatchSize) || self.gradientAccumulationSteps == 1",
            message="gradientAccumulationSteps is derived from globalBatchSize and the world size (micro-steps per "
            "rank = ceil(globalBatchSize / (ranks x perDeviceBatchSize))): remove gradientAccumulationSteps, or remove "
            "globalBatchSize to set the accumulation steps per rank yourself",
            field_path=".gradientAccumulationSteps",
        ),
        cel_rule(
            "self.method == 'dpo' || !has(self.dpo)",
            message="training.dpo configures preference tuning, but training.method is sft: set training.method: dpo "
            "or remove training.dpo",
            field_path=".dpo",
        ),
    )

    epochs: int | None = Field(default=None, ge=1, le=1000)
    """Passes over the training data (exactly one of epochs and maxSteps)."""
    max_steps: int | None = Field(default=None, ge=1, le=10_000_000)
    """Optimizer steps to run (exactly one of epochs and maxSteps)."""
    per_device_batch_size: int = Field(default=1, ge=1, le=4096)
    """Sequences per GPU (or CPU process) per micro-step."""
    gradient_accumulation_steps: int = Field(default=1, ge=1, le=4096)
    """Micro-steps per optimizer step; gradients are only reduced on the last one. With
    globalBatchSize it is derived (leave it unset)."""
    global_batch_size: int | None = Field(default=None, ge=1, le=1_048_576)
    """Sequences per optimizer step across all ranks (packed: blocks; DPO: pairs), the same on any
    world size, so an elastic run that shrinks or grows, or resumes on another number of nodes,
    trains the same model. Each step takes the next globalBatchSize items of one seeded order of
    the epoch that does not depend on the world size, spread over the ranks in micro-batches of
    perDeviceBatchSize (still the memory knob: micro-steps per rank = ceil(globalBatchSize /
    (ranks x perDeviceBatchSize))); a rank left short in a micro-step runs a filler that counts
    no loss and no tokens. Must be at least the number of ranks (with cluster.elastic, of
    maxWorkers). Omitted: perDeviceBatchSize x ranks x gradientAccumulationSteps, which changes
    with the world size."""
    learning_rate: float = Field(default=2e-5, gt=0.0, le=1.0)
    """Peak AdamW learning rate."""
    scheduler: SchedulerType = SchedulerType.COSINE
    """Learning-rate decay after warmup."""
    warmup_steps: int = Field(default=0, ge=0, le=1_000_000)
    """Optimizer steps of linear warmup from 0 to learningRate."""
    weight_decay: float = Field(default=0.0, ge=0.0, le=1.0)
    """AdamW decoupled weight decay."""
    max_grad_norm: float = Field(default=1.0, ge=0.0, le=1e6)
    """Gradient clipping threshold on the global norm (0 disables clipping)."""
    seed: int = Field(default=42, ge=0, le=2**31 - 1)
    """Seed for weights of new modules, data shuffling and dropout."""
    eval_interval: int = Field(default=100, ge=0, le=10_000_000)
    """Evaluate every N optimizer steps and at the end (0: only at the end)."""
    log_interval: int = Field(default=1, ge=1, le=100_000)
    """Log and publish metrics every N optimizer steps."""
    loss_chunks: int = Field(default=1, ge=1, le=64)
    """Compute the LM head and the cross-entropy over this many slices of the sequence, one at a
    time, in forward and again in backward (each slice recomputed there), so the fp32 logits of
    the whole micro-batch (micro-batch x sequence x vocabulary x 4 bytes, and as much again for
    their gradient) never exist at once: peak logits memory divided by about N, for one more LM
    head forward per step. Worth it when the vocabulary is large and sequences long (a 128k
    vocabulary at 8k tokens is 4 GiB of fp32 logits per sequence); same loss and gradients (up to
    float rounding), training and evaluation."""
    collective_timeout_seconds: int = Field(default=600, ge=10, le=86_400)
    """Timeout of every collective (init_process_group's timeout): a dead or hung peer becomes an
    error in bounded time instead of a job that holds its GPUs forever."""
    lora: LoraSpec | None = None
    """Optional LoRA; absent means full fine-tuning."""
    method: TrainingMethod = TrainingMethod.SFT
    """`sft` (next-token loss on the responses) or `dpo` (preference tuning on pairs of a chosen and
    a rejected completion: needs dataset.format preference; settings in training.dpo)."""
    dpo: DpoSpec | None = None
    """Preference-tuning settings for method dpo (omitted: the defaults, beta 0.1, loss sigmoid)."""

    def micro_steps(self, world_size: int) -> int:
        """Micro-steps per optimizer step on each of `world_size` ranks: gradientAccumulationSteps,
        or with globalBatchSize ceil(globalBatchSize / (world_size x perDeviceBatchSize)) (the
        trainer's global_order.GlobalOrder, the planner's memory and time)."""
        if self.global_batch_size is None:
            return self.gradient_accumulation_steps
        return -(-self.global_batch_size // (world_size * self.per_device_batch_size))

    def items_per_step(self, world_size: int) -> int:
        """Training items (sequences, packed blocks or pairs) per optimizer step over all ranks."""
        if self.global_batch_size is not None:
            return self.global_batch_size
        return self.per_device_batch_size * self.gradient_accumulation_steps * world_size


# ---------------------------------------------------------------------------------------- fsdp
class ShardingStrategy(ApiEnum):
    FULL_SHARD = "FULL_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    NO_SHARD = "NO_SHARD"


class MixedPrecision(ApiEnum):
    """Parameter / gradient-reduction / buffer dtypes.

    bf16: compute in bf16, reduce gradients in fp32, keep fp32 master weights and buffers.
    fp16: compute in fp16 with dynamic gradient scaling, reduce in fp32, fp32 master weights.
    fp32: everything fp32.
    pure-bf16: parameters, reductions and optimizer state in bf16 (least memory, least accurate).
    """

    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"
    PURE_BF16 = "pure-bf16"


class CheckpointingMode(ApiEnum):
    NONE = "none"
    FULL = "full"
    SELECTIVE = "selective"
    SELECTIVE_OP = "selective-op"


class FsdpImplementation(ApiEnum):
    FSDP2 = "fsdp2"
    FSDP1 = "fsdp1"


class WrapPolicyType(ApiEnum):
    DECODER_LAYER = "decoderLayer"
    SIZE_BASED = "sizeBased"


class HybridShardSpec(ApiModel):
    """The 2-D device mesh for HYBRID_SHARD: parameters are sharded inside a shard group and
    replicated across replica groups. shardGroupSize x replicaGroupSize = workers x gpusPerWorker."""

    shard_group_size: int = Field(ge=1, le=65536)
    """Ranks a parameter is sharded over (usually the GPUs of one node)."""
    replica_group_size: int = Field(ge=1, le=65536)
    """Number of shard groups holding a full replica (usually the number of nodes)."""


class ActivationCheckpointingSpec(ApiModel):
    """Recompute activations in backward to save memory."""

    mode: CheckpointingMode = CheckpointingMode.FULL
    """`none`, `full` (every decoder layer keeps only its input and recomputes the rest in backward),
    `selective` (every N-th layer checkpointed as in `full`, the others keep everything) or
    `selective-op` (every layer keeps the outputs of its attention kernel and of every second matrix
    multiply, and recomputes the rest (norms, RoPE, SwiGLU, the other projections): torchtitan's
    op-level policy; memory between `none` and `full`, and without LoRA only the k, o and up
    projections' matmuls are recomputed (about 40% of a Llama layer's, `full` recomputes all))."""
    every_n_layers: int = Field(default=2, ge=1, le=1024)
    """With `selective`: checkpoint one decoder layer out of every N (ignored by the other modes)."""


class WrapPolicySpec(ApiModel):
    """Which modules become their own FSDP unit (one all-gather each)."""

    type: WrapPolicyType = WrapPolicyType.DECODER_LAYER
    """`decoderLayer`: one unit per LlamaDecoderLayer (plus the root); `sizeBased`: any module with
    at least minNumParams parameters."""
    min_num_params: int = Field(default=100_000_000, ge=1, le=10**15)
    """Threshold for `sizeBased`."""


class Float8Recipe(ApiEnum):
    """torchao's float8 scaling recipes (`Float8LinearConfig.from_recipe_name`)."""

    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"


class Float8Spec(ApiModel):
    """float8 matmuls for the decoder layers' linears (torchao's float8 training, as torchtitan
    uses it). Inputs, weights and output gradients are cast to float8 with dynamic scales for each
    matmul; master weights, gradients and optimizer state keep their dtype (fsdp.mixedPrecision).
    Needs GPUs with FP8 tensor cores (compute capability 8.9 or newer: H100, H200, L40S); on CPU
    the trainer emulates float8 (tests and smoke runs only: not faster)."""

    model_config = api_config(
        cel_rule(
            "!self.enabled || self.recipe == 'tensorwise' || !self.allGather",
            message="fsdp.float8.allGather (float8 all-gather under FSDP2) works only with tensorwise scaling "
            "(torchao): set fsdp.float8.allGather to false for recipe rowwise, or use recipe tensorwise",
            field_path=".allGather",
        ),
    )

    enabled: bool = False
    """Train the decoder layers' linears (not lm_head; only those whose in and out features are
    divisible by 16) with float8 matmuls."""
    recipe: Float8Recipe = Float8Recipe.TENSORWISE
    """`tensorwise` (one scale per tensor: fastest, and FSDP2 can all-gather float8 weights) or
    `rowwise` (one scale per row: closer to bf16 accuracy, slower)."""
    all_gather: bool = True
    """With tensorwise: cast each weight shard to float8 before FSDP2's all-gather, so the
    all-gather moves half the bytes of bf16 (torchao's enable_fsdp_float8_all_gather); the scales
    of all weights are then computed in one all-reduce after each optimizer step."""


class FsdpSpec(ApiModel):
    """How the model is sharded across ranks."""

    model_config = api_config(
        cel_rule(
            "self.shardingStrategy == 'HYBRID_SHARD' || !has(self.hybridShard)",
            message="hybridShard only applies when shardingStrategy is HYBRID_SHARD: remove it or set the strategy",
            field_path=".hybridShard",
        ),
        cel_rule(
            "!self.cpuOffload || self.shardingStrategy != 'NO_SHARD'",
            message="cpuOffload offloads shards: it needs FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD, not NO_SHARD",
            field_path=".cpuOffload",
        ),
        cel_rule(
            "!has(self.float8) || !self.float8.enabled || self.implementation == 'fsdp2'",
            message="fsdp.float8 converts linears for FSDP2 (torchao's float8 all-gather and scales are FSDP2's): "
            "set fsdp.implementation to fsdp2 or fsdp.float8.enabled to false",
            field_path=".float8.enabled",
        ),
        cel_rule(
            "!has(self.float8) || !self.float8.enabled || self.mixedPrecision != 'fp16'",
            message="fsdp.float8 needs bf16, pure-bf16 or fp32 high precision (torchao's float8 training "
            "supports bf16 and fp32, not fp16 with gradient scaling): set fsdp.mixedPrecision to bf16",
            field_path=".float8.enabled",
        ),
        cel_rule(
            "!self.compile || self.implementation == 'fsdp2'",
            message="fsdp.compile with fsdp.implementation fsdp1: FSDP1's state dict keeps torch.compile's _orig_mod in "
            "the decoder layers' parameter names, so its checkpoints cannot be resumed and its export does not load: "
            "set fsdp.implementation to fsdp2 or fsdp.compile to false",
            field_path=".compile",
        ),
    )

    sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    """FULL_SHARD (reshard after forward), SHARD_GRAD_OP (keep parameters gathered between forward
    and backward), HYBRID_SHARD (shard inside a group, replicate across groups), NO_SHARD (DDP)."""
    hybrid_shard: HybridShardSpec | None = None
    """Group sizes for HYBRID_SHARD; default: shard over the GPUs of a worker, replicate over workers."""
    mixed_precision: MixedPrecision = MixedPrecision.BF16
    """Compute/reduction dtypes (see MixedPrecision)."""
    activation_checkpointing: ActivationCheckpointingSpec = Field(
        default_factory=ActivationCheckpointingSpec
    )
    """Activation checkpointing, applied before sharding."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in host memory."""
    implementation: FsdpImplementation = FsdpImplementation.FSDP2
    """`fsdp2` (fully_shard, DTensor) or `fsdp1` (FullyShardedDataParallel)."""
    compile: bool = False
    """torch.compile each decoder layer."""
    wrap_policy: WrapPolicySpec = Field(default_factory=WrapPolicySpec)
    """Which modules become FSDP units."""
    float8: Float8Spec = Field(default_factory=Float8Spec)
    """float8 training of the decoder layers' linears (torchao); needs FP8 GPUs (H100, H200, L40S)."""


# ------------------------------------------------------------------------------- checkpointing
class CheckpointingSpec(ApiModel):
    """Sharded checkpoints, resume and the final export."""

    model_config = api_config(
        IMMUTABLE_CHECKPOINTS,
        cel_rule(
            "!has(self.volumeClaim) || self.directory.startsWith('/')",
            message="with volumeClaim, directory is where the claim is mounted: make it an absolute path such as "
            "/checkpoints/my-run (an fsspec URI such as s3://bucket/run needs no volumeClaim)",
            field_path=".directory",
        ),
        cel_rule(
            "!has(self.volumeClaim) || !self.directory.matches('" + _cel_string(r"(^|/)\.\.?(/|$)") + "')",
            message="directory must not contain '.' or '..' path segments: write the absolute path, e.g. /checkpoints/my-run",
            field_path=".directory",
        ),
        cel_rule(
            "!has(self.volumeClaim) || ['/dev/shm', '/etc/llamaft', '/mnt/pvc', '/proc', '/sys', '/var/cache/llamaft'].all(m, "
            "self.directory != m && !self.directory.startsWith(m + '/') && "
            "!(m + '/').startsWith(self.directory.endsWith('/') ? self.directory : self.directory + '/'))",
            message="directory collides with a path the worker pod already mounts or needs (/dev/shm, the config at "
            "/etc/llamaft, pvc:// inputs under /mnt/pvc, /proc, /sys, the download cache at /var/cache/llamaft) or a "
            "parent of one: mount the claim "
            "elsewhere, e.g. /checkpoints/my-run",
            field_path=".directory",
        ),
    )

    directory: str = Field(default="/checkpoints", min_length=1, max_length=1024)
    """Where checkpoints go: a path on the checkpoint volume, or an fsspec URI (`s3://...`)."""
    volume_claim: str | None = Field(default=None, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
    """PersistentVolumeClaim mounted at `directory` on every worker (omit for URIs)."""
    every_n_steps: int = Field(default=500, ge=1, le=10_000_000)
    """Save a sharded checkpoint every N optimizer steps (and at the end)."""
    keep_last: int = Field(default=3, ge=1, le=1000)
    """Complete checkpoints kept; older ones are deleted after a newer one is complete."""
    resume: bool = True
    """Resume from the newest complete checkpoint in `directory` when one exists."""
    export_hugging_face: bool = True
    """At the end, write consolidated safetensors that `from_pretrained` loads (LoRA: the adapter)."""
    async_save: bool = Field(default=True, alias="async")
    """Save in the background (DCP async save): training waits only for a staging copy of the
    state, the write happens while the next steps run. One save is in flight at a time; a
    checkpoint counts only once its write has finished and it is marked complete."""
    discard_with_pod: bool = False
    """Accept that this run's results live only in the worker containers: checkpoints, the export
    and local tracker files (TensorBoard, W&B offline) are lost with each pod, no retry can resume
    and a finished run leaves no model. Without it the operator refuses a spec whose results would
    live only in the container; keep them instead on `volumeClaim` (mounted at `directory`), an
    fsspec URI `directory` such as `s3://bucket/run`, or a persistent volume that
    `cluster.podTemplateOverrides` mounts there. `llamaft run --local` writes to this machine and
    ignores it."""


# ------------------------------------------------------------------------------------- cluster
class ElasticSpec(ApiModel):
    """Elastic training: torchrun admits between minWorkers and maxWorkers nodes."""

    model_config = api_config(
        cel_rule(
            "self.minWorkers <= self.maxWorkers",
            message="minWorkers must be <= maxWorkers",
            field_path=".minWorkers",
        ),
    )

    min_workers: int = Field(ge=1, le=4096)
    """Fewest workers the job runs with."""
    max_workers: int = Field(ge=1, le=4096)
    """Most workers the job runs with."""
    shrink_after_seconds: int = Field(default=300, ge=1, le=86_400)
    """How long a worker pod may stay unschedulable (PodScheduled False, reason Unschedulable: no
    node has room for it) before the run goes on with fewer workers instead of waiting: the most
    the scheduler placed that the capacity planner fits, never fewer than minWorkers. With
    scheduling.queueName, how long the job's Kueue Workload may wait for quota before the run asks
    for one worker fewer (again after each further wait, down to minWorkers)."""
    grow_back_after_seconds: int = Field(default=600, ge=1, le=604_800)
    """How long a shrunk run trains at its smaller size before it asks for cluster.workers again,
    at its next checkpoint; pods that still find no room shrink it again after shrinkAfterSeconds."""


class Toleration(ApiModel):
    """A Kubernetes toleration (core/v1 Toleration)."""

    model_config = api_config(
        cel_rule(
            "self.operator == 'Exists' || (has(self.key) && self.key != '')",
            message="a toleration without key must use operator Exists (it then tolerates every taint): set key or operator: Exists",
            field_path=".operator",
        ),
        cel_rule(
            "self.operator != 'Exists' || !has(self.value) || self.value == ''",
            message="operator Exists matches every value of the key: remove value, or use operator: Equal",
            field_path=".value",
        ),
        cel_rule(
            "!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
            message="tolerationSeconds only applies to effect NoExecute: set effect: NoExecute or remove tolerationSeconds",
            field_path=".tolerationSeconds",
        ),
    )

    key: str | None = Field(default=None, max_length=316, pattern=LABEL_KEY_PATTERN.replace("^(", "^$|^(", 1))
    """Taint key (a label key); empty with operator Exists matches every taint."""
    operator: str = Field(default="Equal", pattern=r"^(Equal|Exists)$")
    """`Equal` or `Exists`."""
    value: str | None = Field(default=None, max_length=63, pattern=LABEL_VALUE_PATTERN)
    """Taint value for `Equal` (a label value)."""
    effect: str | None = Field(default=None, pattern=r"^(NoSchedule|PreferNoSchedule|NoExecute)$")
    """Taint effect to match; empty matches all."""
    toleration_seconds: int | None = Field(default=None, ge=-(2**63), le=INT64_MAX)
    """For NoExecute: how long the pod stays bound after the taint appears."""


RESERVED_ENV = (
    "LLAMAFT_CONFIG", "LLAMAFT_SPEC", "LLAMAFT_METRICS_PORT", "LLAMAFT_TERMINATION_GRACE_SECONDS",
    "LLAMAFT_RUN_NAME", "LLAMAFT_RUN_NAMESPACE", "LLAMAFT_RUN_UID", "LLAMAFT_IMAGE", "LLAMAFT_POD_NAME",
    "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK",
)
"""Set on the trainer container by the operator (LLAMAFT_*, TORCH_ELASTIC_SHUTDOWN_TIMEOUT) or by the
training operator (PET_*, MASTER_*, WORLD_SIZE, RANK): a second definition would silently win."""
SECRET_ENV_NAME = r"(?i)(^|_)(TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIALS?)(_|$)"


class EnvVar(ApiModel):
    """A plain environment variable for the trainer container."""

    model_config = api_config(
        cel_rule(
            "!(self.name in [" + ", ".join(f"'{n}'" for n in RESERVED_ENV) + "]) && !self.name.startsWith('PET_')",
            message_expression="self.name + ' is set by the operator (the config and spec paths, metrics port, grace period, the run identity of its trackers) or by the "
            "training operator (PET_*, MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK): remove it from cluster.env'",
            field_path=".name",
            reason="FieldValueForbidden",
        ),
        cel_rule(
            f"self.value == '' || !self.name.matches('{SECRET_ENV_NAME}')",
            message_expression="self.name + ' holds a secret: a literal value is readable by anyone who can read this "
            "LlamaFineTune; put it in a Secret (the Hugging Face token: spec.model.hfTokenSecret) and remove it from cluster.env'",
            field_path=".value",
            reason="FieldValueForbidden",
        ),
        cel_rule(
            f"!(self.value.startsWith('hf_') && size(self.value) >= 30) || self.name.matches('{SECRET_ENV_NAME}')",
            message="the value looks like a Hugging Face token: put the token in a Secret and set spec.model.hfTokenSecret",
            field_path=".value",
            reason="FieldValueForbidden",
        ),
    )

    name: str = Field(min_length=1, max_length=256, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
    """Variable name."""
    value: str = Field(default="", max_length=32768)
    """Variable value."""


class ResourcesSpec(ApiModel):
    """CPU and memory per worker pod (requests = limits, for Guaranteed QoS on GPU nodes)."""

    cpu: str | None = Field(default=None, max_length=64, pattern=POSITIVE_QUANTITY_PATTERN)
    """CPU quantity per worker, e.g. `90`."""
    memory: str | None = Field(default=None, max_length=64, pattern=POSITIVE_QUANTITY_PATTERN)
    """Memory quantity per worker, e.g. `1000Gi`."""


class PullPolicy(ApiEnum):
    ALWAYS = "Always"
    IF_NOT_PRESENT = "IfNotPresent"
    NEVER = "Never"


DEFAULT_TRAINER_IMAGE = "ghcr.io/llamaft/trainer:0.1.0"


class ClusterSpec(ApiModel):
    """Where and on how much hardware the job runs."""

    model_config = api_config(
        cel_rule(
            "!has(self.elastic) || (self.elastic.minWorkers <= self.workers && self.workers <= self.elastic.maxWorkers)",
            message="workers must lie within elastic.minWorkers..maxWorkers",
            field_path=".workers",
        ),
        cel_rule(
            "self.efaDevicesPerWorker == 0 || self.gpusPerWorker > 0",
            message="efaDevicesPerWorker needs GPU workers: set gpusPerWorker",
            field_path=".efaDevicesPerWorker",
        ),
        cel_rule(
            f"has(self.elastic) || self.workers * (self.gpusPerWorker > 0 ? self.gpusPerWorker : 1) <= {MAX_WORLD_SIZE}",
            message=f"workers x gpusPerWorker processes: at most {MAX_WORLD_SIZE} are supported: use fewer workers",
            field_path=".workers",
        ),
        cel_rule(
            f"!has(self.elastic) || self.elastic.maxWorkers * (self.gpusPerWorker > 0 ? self.gpusPerWorker : 1) <= {MAX_WORLD_SIZE}",
            message=f"elastic.maxWorkers x gpusPerWorker processes: at most {MAX_WORLD_SIZE} are supported: lower elastic.maxWorkers",
            field_path=".elastic.maxWorkers",
        ),
    )

    workers: int = Field(default=1, ge=1, le=4096)
    """Worker pods (nodes) in the job."""
    gpus_per_worker: int = Field(default=8, ge=0, le=64)
    """GPUs per worker; torchrun starts one process per GPU (0: one CPU process per worker)."""
    elastic: ElasticSpec | None = None
    """Elastic range for the number of workers."""
    efa_devices_per_worker: int = Field(default=0, ge=0, le=64)
    """AWS EFA devices (vpc.amazonaws.com/efa) per worker; enables the EFA NCCL environment."""
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    """CPU and memory per worker."""
    instance_type: str | None = Field(default=None, max_length=63, pattern=LABEL_VALUE_PATTERN)
    """Pin workers to an instance type (node.kubernetes.io/instance-type), e.g. `p4de.24xlarge`."""
    gpu_model: str | None = Field(default=None, max_length=64)
    """GPU model for capacity planning when instanceType does not say it (on-prem or unlisted
    instances), e.g. `A100-80GB`, `H100`, `H200`, `L40S`, `A10G`, `L4` (`llamaft plan` lists them)."""
    gpu_memory: str | None = Field(default=None, max_length=64, pattern=POSITIVE_QUANTITY_PATTERN)
    """Memory of one GPU for capacity planning (e.g. `80Gi`); overrides the catalog's value."""
    node_selector: dict[str, LabelValue] = Field(default_factory=dict, max_length=64)
    """Extra node labels the workers require."""
    # Keys are label keys too; they are checked on the rendered pod (llamaft.render.admission): a CEL rule
    # over map keys has no length bound, so the API server's cost estimate would refuse the CRD.
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32)
    """Tolerations for tainted GPU nodes."""
    shared_memory_size: str = Field(default="64Gi", max_length=64, pattern=POSITIVE_QUANTITY_PATTERN)
    """Size of the in-memory /dev/shm volume (dataloader workers and NCCL need more than 64Mi)."""
    image: str = Field(default=DEFAULT_TRAINER_IMAGE, min_length=1, max_length=512, pattern=NO_WHITESPACE_PATTERN)
    """Trainer image."""
    image_pull_policy: PullPolicy = PullPolicy.IF_NOT_PRESENT
    """Image pull policy."""
    priority_class_name: str | None = Field(default=None, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
    """PriorityClass of the worker pods."""
    env: list[EnvVar] = Field(default_factory=list, max_length=128)
    """Extra environment for the trainer container (e.g. NCCL_DEBUG=INFO)."""
    termination_grace_period_seconds: int = Field(default=120, ge=0, le=3600)
    """Seconds a worker gets between SIGTERM (preemption, eviction, suspend, a new attempt) and
    SIGKILL: the trainer finishes its step and saves a checkpoint when this leaves time for one."""
    pod_template_overrides: dict[str, Any] | None = None
    """Strategic additions merged into the worker pod template (kept verbatim; not validated)."""


# ---------------------------------------------------------------------------------- rendezvous
class RendezvousBackend(ApiEnum):
    ETCD_V2 = "etcd-v2"
    ETCD = "etcd"
    C10D = "c10d"


class RendezvousSpec(ApiModel):
    """How torchrun's workers find each other."""

    model_config = api_config(
        cel_rule(
            "self.backend != 'c10d' || !has(self.endpoint)",
            message="endpoint is for the etcd backends; c10d rendezvouses on worker 0",
            field_path=".endpoint",
        ),
    )

    backend: RendezvousBackend = RendezvousBackend.ETCD_V2
    """`etcd-v2` (default), `etcd` (legacy, as the reference EKS deployment) or `c10d`."""
    endpoint: str | None = Field(
        default=None, max_length=512, pattern=r"^[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?:" + PORT_PATTERN + "$"
    )
    """External etcd `host:port`. Omitted: the operator runs a managed etcd for this job."""
    max_restarts: int = Field(default=3, ge=0, le=1000)
    """torchrun restarts of the worker group before the job fails."""


# ---------------------------------------------------------------------------------- monitoring
class DcgmSpec(ApiModel):
    """GPU telemetry from dcgm-exporter."""

    enabled: bool = True
    """Create the job's dashboard panels and alerts on DCGM metrics."""
    scrape_selector: dict[str, LabelValue] = Field(
        default_factory=lambda: {"release": "kube-prometheus-stack"}, max_length=32
    )
    """Labels put on monitoring objects so Prometheus selects them."""
    dashboard: bool = True
    """Create a Grafana dashboard ConfigMap for this job."""


class MonitoringSpec(ApiModel):
    """Metrics, dashboards and alerts for the job."""

    dcgm: DcgmSpec = Field(default_factory=DcgmSpec)
    """DCGM GPU monitoring."""
    metrics_port: int = Field(default=8000, ge=1024, le=65535)
    """Port of the trainer's Prometheus endpoint on rank 0 of each worker."""


# ---------------------------------------------------------------------------------- run policy
class RunPolicySpec(ApiModel):
    """Lifecycle of the run."""

    suspend: bool = False
    """Suspend the run (workers are deleted; checkpoints stay); set false to resume."""
    ttl_seconds_after_finished: int | None = Field(default=None, ge=0, le=INT32_MAX)
    """Delete the finished job's pods after this many seconds."""
    active_deadline_seconds: int | None = Field(default=None, ge=1, le=INT32_MAX)
    """Fail the run when it runs longer than this."""
    backoff_limit: int | None = Field(default=None, ge=0, le=1000)
    """Pod failures the training operator tolerates before failing the job."""
    retry_budget: int = Field(default=3, ge=0, le=100)
    """Whole-gang restarts the operator may spend on retryable failures (lost node, eviction,
    preemption, OOM kill, NCCL error or hang, GPU XID, stall, closed rendezvous); each one resets
    the rendezvous and resubmits from the newest complete checkpoint. 0 turns recovery off."""
    progress_deadline_seconds: int = Field(default=900, ge=10, le=604_800)
    """A running attempt whose step does not advance for this long is a retryable `Stalled` failure."""
    startup_grace_seconds: int = Field(default=1800, ge=0, le=604_800)
    """Extra time before the first step (image pull, model loading) on top of progressDeadlineSeconds."""
    repeated_failure_limit: int = Field(default=3, ge=2, le=100)
    """The same failure at the same step in this many consecutive attempts is permanent: the run
    ends `Failed` instead of spending the rest of the budget on it."""


# -------------------------------------------------------------------------------- scheduling
class GangSpec(ApiModel):
    """Gang scheduling without Kueue: the PyTorchJob's `runPolicy.schedulingPolicy`, read by
    Volcano or the scheduler-plugins coscheduling plugin; every worker is scheduled or none is."""

    scheduler_name: str = Field(default="volcano", min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
    """The pods' `schedulerName`: `volcano`, or the scheduler-plugins scheduler's name (e.g.
    `scheduler-plugins-scheduler`)."""
    queue: str | None = Field(default=None, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
    """Volcano queue (schedulingPolicy.queue)."""
    priority_class: str | None = Field(default=None, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
    """PriorityClass of the PodGroup (schedulingPolicy.priorityClass)."""
    schedule_timeout_seconds: int | None = Field(default=None, ge=1, le=INT32_MAX)
    """How long the PodGroup may wait for all its pods to be schedulable."""


class TopologyMode(ApiEnum):
    REQUIRED = "required"
    PREFERRED = "preferred"


KUEUE_TOPOLOGY_ANNOTATIONS = {
    TopologyMode.REQUIRED: "kueue.x-k8s.io/podset-required-topology",
    TopologyMode.PREFERRED: "kueue.x-k8s.io/podset-preferred-topology",
}
"""Kueue's PodSet annotations for topology-aware scheduling (kueue apis/kueue/v1beta2/topology_types.go)."""


class TopologySpec(ApiModel):
    """Topology-aware placement of the workers through Kueue's topology-aware scheduling (TAS): the
    worker pod template gets `kueue.x-k8s.io/podset-required-topology` (or `-preferred-topology`)
    set to `level`, and Kueue admits the job only into a topology domain (block, rack, host) of
    that level that fits every worker."""

    model_config = api_config(
        cel_rule(
            "!self.level.matches('^[^/]{254,}/')",
            message="a label key's prefix (before '/') has at most 253 characters",
            field_path=".level",
        ),
    )

    mode: TopologyMode = TopologyMode.REQUIRED
    """`required`: all workers in one domain of `level`, or the job waits; `preferred`: Kueue tries
    `level`, then each level above it, then admits the workers spread over domains."""
    level: str = Field(min_length=1, max_length=316, pattern=LABEL_KEY_PATTERN)
    """A node label of a level of the Kueue Topology the queue's ResourceFlavor names, e.g.
    `network.amazonaws.com/efa-block` or `kubernetes.io/hostname`."""


class SchedulingSpec(ApiModel):
    """Queueing, gang scheduling and topology-aware placement on a shared cluster."""

    model_config = api_config(
        cel_rule(
            "!has(self.queueName) || !has(self.gang)",
            message="queueName hands the job to Kueue, which admits all its pods at once; gang is for Volcano or "
            "scheduler-plugins without Kueue: set one of them",
            field_path=".gang",
        ),
        cel_rule(
            "!has(self.priorityClass) || has(self.queueName)",
            message="priorityClass is Kueue's WorkloadPriorityClass and needs queueName; without Kueue use "
            "cluster.priorityClassName (pods) or gang.priorityClass (PodGroup)",
            field_path=".priorityClass",
        ),
        cel_rule(
            "!has(self.topology) || has(self.queueName) || has(self.gang)",
            message="topology is carried out by Kueue's topology-aware scheduling: set queueName to a LocalQueue whose "
            "ClusterQueue has a ResourceFlavor with topologyName, or remove topology",
            field_path=".topology",
        ),
        cel_rule(
            "!has(self.topology) || !has(self.gang)",
            message="Volcano's network topology cannot be asked for through the job: the training operator (v1.9) "
            "builds the PodGroup from schedulingPolicy without networkTopology and rewrites it on every sync, and "
            "Kubeflow Trainer takes it from the runtime's podGroupPolicy.volcano.networkTopology: queue with "
            "queueName (Kueue TAS) instead of gang, or remove topology (and use a runtime with networkTopology)",
            field_path=".topology",
        ),
    )

    queue_name: str | None = Field(default=None, max_length=63, pattern=NAME_PATTERN)
    """Kueue LocalQueue in this namespace: the job gets the `kueue.x-k8s.io/queue-name` label, waits
    (suspended, phase Queued) until Kueue admits it, then runs."""
    priority_class: str | None = Field(default=None, max_length=63, pattern=LABEL_VALUE_PATTERN)
    """Kueue WorkloadPriorityClass (`kueue.x-k8s.io/priority-class` label)."""
    gang: GangSpec | None = None
    """Gang scheduling through Volcano or scheduler-plugins (no Kueue)."""
    topology: TopologySpec | None = None
    """Place all workers in one network topology domain (Kueue TAS; needs queueName)."""


# ------------------------------------------------------------------------------------ backend
class Backend(ApiEnum):
    PYTORCH_JOB = "PyTorchJob"
    TRAIN_JOB = "TrainJob"
    AUTO = "auto"


class RuntimeRef(ApiModel):
    """The Kubeflow Trainer runtime a TrainJob uses."""

    name: str = Field(default="torch-distributed", min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
    """Runtime name."""
    kind: str = Field(default="ClusterTrainingRuntime", pattern=r"^(ClusterTrainingRuntime|TrainingRuntime)$")
    """ClusterTrainingRuntime (cluster-wide) or TrainingRuntime (this namespace)."""


class TrainJobSpec(ApiModel):
    """Settings for the Kubeflow Trainer v2 backend (`backend: TrainJob`)."""

    runtime_ref: RuntimeRef = Field(default_factory=RuntimeRef)
    """The (Cluster)TrainingRuntime the TrainJob references."""


# -------------------------------------------------------------------------------------- spec
class PreflightMode(ApiEnum):
    ENFORCE = "Enforce"
    WARN = "Warn"
    OFF = "Off"


HYBRID_GROUPS_RULE = cel_rule(
    "!has(self.fsdp.hybridShard) || self.fsdp.hybridShard.shardGroupSize * self.fsdp.hybridShard.replicaGroupSize == self.cluster.workers * (self.cluster.gpusPerWorker > 0 ? self.cluster.gpusPerWorker : 1)",
    message="shardGroupSize x replicaGroupSize must equal workers x gpusPerWorker (the world size)",
    field_path=".fsdp.hybridShard",
)
HYBRID_DIVIDES_RULE = cel_rule(
    "!has(self.fsdp.hybridShard) || (self.cluster.workers * (self.cluster.gpusPerWorker > 0 ? self.cluster.gpusPerWorker : 1)) % self.fsdp.hybridShard.shardGroupSize == 0",
    message="shardGroupSize must divide workers x gpusPerWorker (the world size)",
    field_path=".fsdp.hybridShard.shardGroupSize",
)
ELASTIC_HYBRID_RULE = cel_rule(
    "!has(self.cluster.elastic) || self.fsdp.shardingStrategy != 'HYBRID_SHARD' || !has(self.fsdp.hybridShard)",
    message="explicit hybridShard group sizes cannot follow an elastic world size: drop cluster.elastic or fsdp.hybridShard",
    field_path=".fsdp.hybridShard",
)
HYBRID_WORLD_RULE = cel_rule(
    "self.fsdp.shardingStrategy != 'HYBRID_SHARD' || (has(self.cluster.elastic) ? self.cluster.elastic.minWorkers : self.cluster.workers) * (self.cluster.gpusPerWorker > 0 ? self.cluster.gpusPerWorker : 1) >= 2",
    message="HYBRID_SHARD shards inside groups and replicates across them: it needs at least 2 processes "
    "(workers x gpusPerWorker); on one process use FULL_SHARD",
    field_path=".fsdp.shardingStrategy",
)
METRICS_PORT_RULE = cel_rule(
    "self.rendezvous.backend != 'c10d' || self.monitoring.metricsPort != 29400",
    message="metricsPort 29400 is the c10d rendezvous port on worker 0: choose another metricsPort",
    field_path=".monitoring.metricsPort",
)
IMMUTABLE_BACKEND = cel_rule(
    "self.backend == oldSelf.backend",
    message="backend is immutable: a running job cannot change kind; create a new LlamaFineTune",
    field_path=".backend",
    reason="FieldValueForbidden",
)
LORA_FSDP1_RULE = cel_rule(
    "!has(self.training.lora) || !self.training.lora.enabled || self.fsdp.implementation == 'fsdp2'",
    message="LoRA is supported with fsdp.implementation fsdp2",
    field_path=".fsdp.implementation",
)


class CacheSpec(ApiModel):
    """Where downloaded model and dataset files are kept (the Hugging Face cache)."""

    volume_claim: str | None = Field(default=None, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
    """A ReadWriteMany PersistentVolumeClaim mounted on every worker as the download cache: each
    file of the model and the dataset is fetched once per run, and nodes that join later or a retry
    on other nodes read it there. Without one, each node downloads into its own emptyDir, again
    on every attempt (status says so in its SharedCache condition)."""


class TensorBoardSpec(ApiModel):
    """TensorBoard event files (torch.utils.tensorboard), read with `tensorboard --logdir`."""

    directory: str | None = Field(default=None, min_length=1, max_length=1024)
    """Where the event files go; default `<checkpointing.directory>/tensorboard` (on the checkpoint
    volume, so every attempt of the run appends to the same run)."""


class MlflowSpec(ApiModel):
    """An MLflow tracking server: one MLflow run per fine-tune, continued by every attempt."""

    tracking_uri: str = Field(min_length=1, max_length=1024, pattern=NO_WHITESPACE_PATTERN)
    """The server, e.g. `http://mlflow.mlflow.svc:5000`."""
    experiment: str = Field(default="llamaft", min_length=1, max_length=500)
    """The experiment the run goes in (created when missing)."""
    credentials_secret: str | None = Field(default=None, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
    """A Secret in the CR's namespace with the server's credentials: key `token` (a bearer token),
    or keys `username` and `password` (basic auth). Given to rank 0 as MLflow's own environment
    variables; never logged, never a parameter."""


class WandbMode(ApiEnum):
    ONLINE = "online"
    OFFLINE = "offline"


WANDB_KEY_RULE = cel_rule(
    "self.mode != 'online' || has(self.apiKeySecret)",
    message="wandb.mode online needs wandb.apiKeySecret (a Secret key holding the W&B API key); "
    "or set mode: offline",
    field_path=".apiKeySecret",
    reason="FieldValueRequired",
)


class WandbSpec(ApiModel):
    """Weights & Biases: one W&B run per fine-tune, continued by every attempt."""

    model_config = api_config(WANDB_KEY_RULE)

    project: str = Field(min_length=1, max_length=128)
    """The W&B project."""
    entity: str | None = Field(default=None, min_length=1, max_length=128)
    """The team or user; default the API key's own."""
    api_key_secret: SecretKeyRef | None = None
    """The Secret key holding the API key (`online` needs one)."""
    mode: WandbMode = WandbMode.ONLINE
    """`offline` writes the run under `<checkpointing.directory>/wandb` for a later `wandb sync`."""
    base_url: str | None = Field(default=None, min_length=1, max_length=1024, pattern=NO_WHITESPACE_PATTERN)
    """A self-hosted W&B server; default W&B's cloud."""


class TrackingSpec(ApiModel):
    """Experiment trackers the run logs to (rank 0 only): parameters once, every logged step's
    loss, learning rate, grad norm, tokens/s, MFU and memory, every eval's loss and perplexity. A
    tracker that is down or slow never stops or slows training: its points wait in a bounded
    queue and are dropped, with a warning, when it stays away."""

    tensorboard: TensorBoardSpec | None = None
    """TensorBoard event files; `llamaft run --local` writes them by default."""
    mlflow: MlflowSpec | None = None
    """An MLflow tracking server."""
    wandb: WandbSpec | None = None
    """Weights & Biases."""


class EvalMetric(ApiEnum):
    ROUGE = "rouge"


class EvaluationSpec(ApiModel):
    """Generations and task scores, beside the held-out loss: the first `samples` held-out records'
    prompts are completed by the model (greedy, at most maxNewTokens) at every eval and at the
    end, and scored against their references."""

    model_config = api_config(
        cel_rule(
            "size(self.metrics) == 0 || self.samples > 0",
            message="evaluation.metrics score generations: set evaluation.samples (how many held-out prompts to generate)",
            field_path=".samples",
            reason="FieldValueRequired",
        ),
    )

    samples: int = Field(default=0, ge=0, le=256)
    """Held-out prompts generated at each eval and at the end (0: none). Logged as JSON lines and
    to the trackers; every rank runs the generation (under FSDP each forward is a collective)."""
    max_new_tokens: int = Field(default=64, ge=1, le=4096)
    """The longest generation, in tokens (it stops earlier at the end-of-sequence token)."""
    metrics: list[EvalMetric] = Field(default_factory=list, max_length=4)
    """Task scores of the generations against the references: `rouge` (ROUGE-1/2/L F1 with
    stemming, rouge-score's, as summarisation literature such as samsum's reports)."""


EVALUATION_FSDP2_RULE = cel_rule(
    "self.evaluation.samples == 0 || self.fsdp.implementation == 'fsdp2'",
    message="evaluation.samples generates with the sharded model, which needs fsdp.implementation fsdp2",
    field_path=".evaluation.samples",
)


DORA_FLOAT8_RULE = cel_rule(
    "!has(self.training.lora) || !self.training.lora.enabled || !self.training.lora.useDora || "
    "!self.fsdp.float8.enabled || self.fsdp.float8.recipe != 'tensorwise' || !self.fsdp.float8.allGather",
    message="training.lora.useDora with fsdp.float8.allGather: DoRA's weight norm reads each base weight, which FSDP2 "
    "then all-gathers as a float8 tensor that peft cannot dequantize (torchao): set fsdp.float8.allGather to false "
    "or training.lora.useDora to false",
    field_path=".fsdp.float8.allGather",
)


STREAMING_STEPS_RULE = cel_rule(
    "!self.dataset.streaming || has(self.training.maxSteps)",
    message="a streamed dataset (dataset.streaming) has no known length, so epochs cannot be counted: "
    "set training.maxSteps instead of training.epochs",
    field_path=".training.maxSteps",
    reason="FieldValueRequired",
)


DPO_DATA_RULE = cel_rule(
    "self.training.method != 'dpo' || self.dataset.format == 'preference'",
    message="training.method dpo learns from pairs of a chosen and a rejected completion: set dataset.format: "
    "preference (records with prompt, chosen and rejected), or training.method: sft",
    field_path=".dataset.format",
)
PREFERENCE_METHOD_RULE = cel_rule(
    "self.dataset.format != 'preference' || self.training.method == 'dpo'",
    message="dataset.format preference holds pairs for preference tuning, which training.method sft cannot learn "
    "from: set training.method: dpo, or use a format of single responses (jsonl, chat) for sft",
    field_path=".training.method",
)
DPO_PACKING_RULE = cel_rule(
    "self.training.method != 'dpo' || !self.dataset.packing",
    message="training.method dpo never packs: a pair's chosen and rejected sequences are one example and go through "
    "the model side by side, each padded on its own: set dataset.packing to false",
    field_path=".dataset.packing",
)
DPO_RULES = (DPO_DATA_RULE, PREFERENCE_METHOD_RULE, DPO_PACKING_RULE)
GLOBAL_BATCH_STREAMING_RULE = cel_rule(
    "!has(self.training.globalBatchSize) || !self.dataset.streaming",
    message="training.globalBatchSize takes each step's items from one global order of the epoch, which needs the "
    "token store; a streamed dataset (dataset.streaming) is read by each rank in arrival order: set dataset.streaming: "
    "false or remove training.globalBatchSize",
    field_path=".training.globalBatchSize",
)
_PROCESSES = "(self.cluster.gpusPerWorker > 0 ? self.cluster.gpusPerWorker : 1)"
GLOBAL_BATCH_WORLD_RULE = cel_rule(
    f"!has(self.training.globalBatchSize) || has(self.cluster.elastic) || "
    f"self.training.globalBatchSize >= self.cluster.workers * {_PROCESSES}",
    message="globalBatchSize is below workers x gpusPerWorker ranks: every rank needs at least one sequence per step; "
    "set globalBatchSize >= workers x gpusPerWorker, or use fewer workers",
    field_path=".training.globalBatchSize",
)
GLOBAL_BATCH_ELASTIC_RULE = cel_rule(
    f"!has(self.training.globalBatchSize) || !has(self.cluster.elastic) || "
    f"self.training.globalBatchSize >= self.cluster.elastic.maxWorkers * {_PROCESSES}",
    message="globalBatchSize is below elastic.maxWorkers x gpusPerWorker ranks, the most this run may get: every rank "
    "needs at least one sequence per step; set globalBatchSize >= elastic.maxWorkers x gpusPerWorker or lower "
    "elastic.maxWorkers",
    field_path=".training.globalBatchSize",
)


class TrainingJobConfig(ApiModel):
    """The part of the spec the trainer reads (mounted into every worker as JSON)."""

    model_config = api_config(STREAMING_STEPS_RULE, EVALUATION_FSDP2_RULE, DORA_FLOAT8_RULE, *DPO_RULES,
                              GLOBAL_BATCH_STREAMING_RULE)

    model: ModelSpec
    """The pretrained model."""
    dataset: DatasetSpec
    """The training data."""
    training: TrainingSpec = Field(default_factory=lambda: TrainingSpec(epochs=1))
    """Optimisation settings; omitted means one epoch with the defaults."""
    fsdp: FsdpSpec = Field(default_factory=FsdpSpec)
    """FSDP sharding, precision and memory settings."""
    checkpointing: CheckpointingSpec = Field(default_factory=CheckpointingSpec)
    """Checkpoints, resume and export."""
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    """Experiment tracking: TensorBoard, MLflow, Weights & Biases."""
    evaluation: EvaluationSpec = Field(default_factory=EvaluationSpec)
    """Generations of held-out prompts and their task scores (ROUGE)."""


class LlamaFineTuneSpec(TrainingJobConfig):
    """A Llama fine-tuning run with PyTorch FSDP on a Kubeflow PyTorchJob or TrainJob."""

    model_config = api_config(
        HYBRID_GROUPS_RULE, HYBRID_DIVIDES_RULE, ELASTIC_HYBRID_RULE, LORA_FSDP1_RULE, HYBRID_WORLD_RULE,
        METRICS_PORT_RULE, IMMUTABLE_BACKEND, STREAMING_STEPS_RULE, EVALUATION_FSDP2_RULE, DORA_FLOAT8_RULE,
        *DPO_RULES, GLOBAL_BATCH_STREAMING_RULE, GLOBAL_BATCH_WORLD_RULE, GLOBAL_BATCH_ELASTIC_RULE,
    )

    cluster: ClusterSpec = Field(default_factory=ClusterSpec)
    """Workers, GPUs, scheduling and the trainer image."""
    cache: CacheSpec = Field(default_factory=CacheSpec)
    """The shared download cache for model and dataset files."""
    rendezvous: RendezvousSpec = Field(default_factory=RendezvousSpec)
    """torchrun rendezvous."""
    monitoring: MonitoringSpec = Field(default_factory=MonitoringSpec)
    """GPU monitoring and trainer metrics."""
    run_policy: RunPolicySpec = Field(default_factory=RunPolicySpec)
    """Suspend, deadlines, retries."""
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)
    """Kueue queueing, gang scheduling, topology-aware placement."""
    backend: Backend = Backend.PYTORCH_JOB
    """The Kubeflow job the run becomes: `PyTorchJob` (training operator v1), `TrainJob` (Kubeflow
    Trainer v2) or `auto` (the one the cluster serves; when both are, TrainJob unless the spec needs
    something only a PyTorchJob carries out). Immutable."""
    train_job: TrainJobSpec = Field(default_factory=TrainJobSpec)
    """TrainJob backend settings (runtime)."""
    preflight: PreflightMode = PreflightMode.ENFORCE
    """Capacity check before anything is created (`llamaft plan` shows it): `Enforce` refuses a run
    whose estimated per-GPU memory exceeds the GPU's (phase Failed, reason WillNotFit), `Warn` only
    reports it in the CapacityFits condition and an event, `Off` skips the check."""

    def training_config(self) -> TrainingJobConfig:
        """The trainer's view of this spec: the same validated values, nothing re-declared."""
        return TrainingJobConfig.model_validate(
            self.model_dump(include=set(TrainingJobConfig.model_fields), by_alias=True)
        )

    @property
    def world_size(self) -> int:
        """Total training processes: workers x processes per worker."""
        return self.cluster.workers * max(self.cluster.gpus_per_worker, 1)
