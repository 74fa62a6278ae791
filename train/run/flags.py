"""The words of ``python -m train.gpt``'s command line: the values each choice flag accepts
and the ``--help`` text of every flag, keyed by its :class:`train.run.config.Config` field.

Kept apart from ``train/run/config.py`` (which imports it) so the dataclass and its checks
stay short; nothing here imports jax or the config.
"""
from __future__ import annotations

PRESET_NAMES = ("tiny", "tiny-moe", "small", "350m", "1b")
OPTIMIZERS = ("dion", "dion2", "nordion2", "normuon", "muon", "adamw", "lion")
# Base learning rates; --lr overrides. The orthogonal family's is the reference's own
# (microsoft/dion's 160m configs); on tiny, 200 steps, the best of a 2x grid was 0.04
# for all four (benchmarks/results/optimizer_comparison.md).
DEFAULT_LR = {"dion": 0.02, "dion2": 0.02, "nordion2": 0.02, "normuon": 0.02, "muon": 0.02, "adamw": 3e-3, "lion": 3e-4}
DECAY_STYLES = ("constant", "linear", "cosine", "wsd")
# The values of each flag with a fixed set of them (argparse's choices=).
CHOICES = {"preset": PRESET_NAMES, "dtype": ("float32", "bfloat16", "float16"),
           "attention": ("auto", "xla", "cudnn"), "optimizer": OPTIMIZERS,
           "qk_norm": ("none", "rms", "rms_scale"), "mlp": ("relu2", "swiglu"),
           "lr_decay_style": DECAY_STYLES, "dion_qr_method": ("auto", "shifted_cqr", "cqr", "rcqr", "qr", "polar"),
           "dion_power_precision": ("default", "float32", "tensorfloat32", "bfloat16"),
           "dion_qr_precision": ("float32", "tensorfloat32x3"),
           "dion_scale_rule": ("fan_ratio", "spectral", "max_one", "none"),
           "dion_scalar_optimizer": ("adamw", "lion"), "ortho_dtype": ("bfloat16", "float32"),
           "loss_type": ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"),
           "importance_sampling_level": ("token", "sequence"), "scale_rewards": ("group", "batch", "none"),
           "multi_objective_aggregation": ("sum_then_normalize", "normalize_then_sum"),
           "grad_norm": ("sketch", "rms", "exact")}
# Other names of a flag: TRL's, where it names the same thing differently.
ALIASES = {"updates_per_rollout": ("--num-iterations",)}
# The placeholder --help shows for a flag's value, where its name does not say it.
METAVARS = {"data": "SPEC", "reward": "NAME[=WEIGHT]", "prompts": "PATH", "tensorboard": "DIR", "remat": "POLICY",
            "fp8": "RECIPE"}
# The value of a flag given without one, for flags whose value may be left off.
BARE_VALUES = {"tensorboard": "", "remat": "full", "fp8": "current"}
# What runs saved before a flag took words wrote for it, and the word it reads as now.
FORMER_VALUES = {"remat": {True: "full", False: "none"}, "fp8": {True: "current", False: "none"}}
# --fp8's recipes (models.fp8.RECIPES).
FP8_RECIPES = ("none", "current", "delayed")
# --remat's policies (models.remat.POLICIES: what each keeps), one line of --help each.
REMAT_POLICIES = {
    "none": "keep every matrix product, the attention's scores too (the default)",
    "full": "keep each layer's input only, recompute the rest (Megatron's full; --remat alone)",
    "selective": "recompute the attention's core, keep the projections, its output and the MLP's"
                 " products (Megatron's selective)",
    "save_qkv_proj": "keep the query, key and value projections (MaxText's)",
    "save_dot_except_mlp": "keep the attention's projections and out projection, recompute the MLP (MaxText's)",
    "save_out_proj": "keep the attention's out projection (MaxText's)",
    "qkv_proj_offloaded": "save_qkv_proj's tensors in pinned host memory (MaxText's)",
    "minimal_offloaded": "every projection and MLP product in pinned host memory, the attention's core"
                         " recomputed (MaxText's)",
}

HELP = {
    "preset": "model size: %s (default tiny: 4 layers x 128, seq 128)" % "|".join(PRESET_NAMES),
    "qk_norm": "none|rms|rms_scale: QK-norm of the preset's attention (default rms, the reference's;"
               " none as Llama, rms_scale as Qwen3)",
    "mlp": "relu2|swiglu: the preset's MLP (default relu2, the reference's; swiglu as Llama and Qwen3:"
           " with --qk-norm none a Llama, with rms_scale a Qwen3, which train.export writes)",
    "init_from": "hf:DIR or hf:ORG/NAME[@REVISION]: start from a Hugging Face Llama, Qwen3 or Qwen3-MoE"
                 " checkpoint instead of a random preset: the local folder DIR (config.json +"
                 " safetensors; a folder wins over a Hub id of the same name) or a Hub repository,"
                 " its config, tokenizer and safetensors fetched into the Hugging Face cache (the hub"
                 " extra; HF_HUB_OFFLINE=1 reads the cache only, HF_TOKEN authenticates); --seq-len sets"
                 " the training length (default min(max_position_embeddings, 1024)); the run is"
                 " runs/NAME-OPTIMIZER (NAME: the folder's or repository's) unless --name/--run-dir",
    "num_layers": "override the preset's number of transformer layers",
    "hidden_size": "override the preset's model width d_model",
    "num_attention_heads": "override the preset's attention heads (must divide the hidden size)",
    "seq_len": "override the preset's tokens per sequence",
    "dtype": "compute dtype float32|bfloat16|float16 (default: bfloat16 on GPU, float32 on"
             " CPU); parameters and optimizer state stay float32; float16 scales the loss"
             " dynamically (Megatron's --fp16)",
    "attention": "auto|xla|cudnn: implementation of attention (default auto: cuDNN's fused"
                 " attention on an NVIDIA GPU in bfloat16 or float16, XLA's otherwise)",
    "remat": "recompute policy: what each layer keeps for the backward pass, the rest recomputed"
             " (less memory, more compute): %s; custom:NAME=PLACE,... keeps the named tensors (layer_input,"
             " query_proj, key_proj, value_proj, attention_out, out_proj, mlp_gate, mlp_up, expert_gate,"
             " expert_up, expert_down) on the device or the host, recomputes the others; --remat alone is"
             " full; on CPU host placements stay on the device (XLA:CPU does not move them)"
             % "; ".join(f"{k}: {v}" for k, v in REMAT_POLICIES.items()),
    "fp8": "the transformer blocks' matrix products (query, key, value, out projection, MLP, experts) in FP8:"
           " e4m3 inputs and weights, e5m2 gradients, float32 accumulation, each tensor scaled by"
           " its own absolute maximum of this step (recipe current, --fp8 alone), or by the largest"
           " of its last 16 steps' (delayed: Transformer Engine's DelayedScaling, the histories"
           " checkpointed beside the parameters; train.grpo samples and scores with them too); none: off,"
           " the default; the embedding, LM head, norms, softmax, loss and the router stay in --dtype,"
           " the parameters float32 (docs/fp8.md)",
    "loss_chunk": "tokens of each device that go through the LM head and the loss at a time: the"
                  " peak holds that many tokens' logits (and softmax and gradient), not the whole"
                  " micro-batch's, for the head's product done twice; 0 forms them all at once"
                  " (default 0)",
    "sequence_parallel": "shard activations along the sequence over tp between layers",
    "virtual_stages": "stages per pp device of a circular (interleaved) pipeline (default 1)",
    "num_experts": "mixture of experts: the MLP of every layer (every --moe-every-th) becomes"
                   " this many experts of the preset's MLP width, split over the mesh's ep axis"
                   " (default: the preset's; tiny-moe has 8; 0 for a dense MLP)",
    "moe_ffn_hidden_size": "hidden width of each expert (default: the preset's MLP width; the"
                           " dense layers of --moe-every keep it)",
    "moe_every": "experts on every n-th layer only (layers n-1, 2n-1, ...; Qwen3-MoE's"
                 " decoder_sparse_step), dense MLPs between; n divides the layers (default 1:"
                 " every layer)",
    "moe_top_k": "experts per token (default 2)",
    "moe_capacity_factor": "cap each expert at ceil(c x seq_len x top_k / experts) tokens per"
                           " sequence and drop the overflow, counted in the log (default:"
                           " dropless, every token routed)",
    "moe_shared_expert": "add a dense shared expert of the MLP width that every token goes through",
    "moe_aux_loss_coeff": "weight of each MoE layer's load-balancing loss (default 0.01)",
    "moe_z_loss_coeff": "weight of each MoE layer's router z-loss (default 0.001)",
    "data": "training data: stdlib (the embedded corpus, default) | fineweb:GLOB |"
            " megatron:PREFIX | sft:FILE.jsonl (lines {\"prompt\", \"completion\"}, loss on the"
            " completion, or {\"messages\": [...]}, rendered by --init-from's chat template,"
            " loss on the assistant turns; tokenized with --init-from's tokenizer, else bytes) | a blend W1 SRC1 W2 SRC2 ... (e.g. 0.7 fineweb:'d/*.bin' 0.3 stdlib)",
    "valid_data": "validation data spec (default: stdlib:val for the embedded corpus, none otherwise)",
    "pack": "sft: data: pack several examples per sequence, attention kept within each"
            " (default on; --no-pack: one example per sequence)",
    "document_mask": "pretraining data: attention within each document of a window and"
                     " positions restarting at each end-of-document token (Megatron's"
                     " --reset-attention-mask --reset-position-ids; default off)",
    "vocab_size": "tokenizer vocabulary size, where the data does not record it (Megatron datasets)",
    "optimizer": "%s (default dion: Dion on matrices, --dion-scalar-optimizer on the rest;"
                 " dion2 (fraction 1/4), nordion2 (fraction 1/4), normuon and muon: dion_jax's,"
                 " sharded like Dion, with"
                 " the same scalar optimizer on the rest; adamw, lion: optax's on everything)"
                 % "|".join(OPTIMIZERS),
    "lr": "peak learning rate (default: %s)" % ", ".join(f"{k} {v:g}" for k, v in DEFAULT_LR.items()),
    "min_lr": "learning rate at the end of the decay (default 0)",
    "lr_warmup_steps": "linear warmup to --lr over this many steps (default: 5%% of the decay steps)",
    "lr_decay_style": "%s after warmup (default cosine; wsd: constant, then linear decay over"
                      " --lr-wsd-decay-steps)" % "|".join(DECAY_STYLES),
    "lr_decay_steps": "optimizer steps over which warmup and decay run (default --steps; train.grpo:"
                      " --steps x --updates-per-rollout); set it when a run is split over several"
                      " invocations",
    "lr_wsd_decay_steps": "final decay steps of wsd (default: a fifth of the decay steps)",
    "weight_decay": "decoupled weight decay of the matrices, times the learning rate (default 0.01)",
    "qk_clip_threshold": "QK-clip (MuonClip): after each step, shrink the query and key kernels of every"
                         " attention head whose largest logit exceeded this, to it (default off;"
                         " needs --qk-norm none or a Llama checkpoint); the log shows the largest"
                         " logit and the clipped heads",
    "scalar_weight_decay": "weight decay of everything else: embeddings, LM head, norms (default 0,"
                           " microsoft/dion's recipe; runs saved before this flag resume with"
                           " --weight-decay's value)",
    "clip_grad": "clip the gradient to this global norm, 0 for none (default 1.0); with Dion's"
                 " per-replica gradients the norm --grad-norm says",
    "grad_norm": "sketch|rms|exact: the gradient norm of --clip-grad and the log where Dion's replicas"
                 " keep their own gradients (rp > 1), whose mean no device holds: sketch (default) an"
                 " unbiased estimate of the mean's norm from --grad-norm-sketch-size numbers per replica"
                 " all-reduced over rp (within about 2%% of it at 1024); rms the root mean square of the"
                 " replicas' norms, an upper bound of the mean's, for one scalar all-reduce; exact the"
                 " mean's norm, for an all-reduce of every Dion matrix's gradient over rp each step"
                 " (as many bytes as AdamW's gradient sync, which Dion's compressed sync avoids)",
    "grad_norm_sketch_size": "numbers in each replica's sketch of --grad-norm sketch, a power of two"
                             " (default 1024: 4 kB; the estimate's relative spread is about"
                             " sqrt(2/size) of the squared norm)",
    "skip_spikes": "skip the update of a step whose loss or gradient norm exceeds the mean of the"
                   " last 128 steps by this many of their standard deviations, once 64 are known"
                   " (MaxText's skip_step_on_spikes and Levanter's SkipStepConfig: 6 over 128);"
                   " counted in the log's skipped and spike iterations (default 0: off)",
    "max_skipped": "stop after this many consecutive skipped steps (default 10): steps whose"
                   " loss, gradient, new parameters or optimizer state would not be finite,"
                   " float16 overflows included, and --skip-spikes' spikes; skipped steps change nothing",
    "initial_loss_scale": "--dtype float16: the loss scale a run starts from (default 65536 ="
                          " 2^16, as torch.amp's; each halving is a skipped step: from Megatron's"
                          " 2^32, tiny skips 16, past the default --max-skipped); a resumed run"
                          " continues from its saved scale",
    "loss_scale_window": "--dtype float16: double the loss scale after this many finite steps"
                         " in a row (default 1000, as Megatron's)",
    "min_loss_scale": "--dtype float16: never halve the loss scale below this (default 1, as"
                      " Megatron's)",
    "dion_rank_fraction": "Dion's rank r / min(m, n), in (0, 1] (default by the model's width: full rank"
                          " below 768, 1/2 from 768, i.e. small, 350m, 1b and imported models; lower"
                          " ranks cut Dion's compute and what its replicas exchange, (m + n)·r per"
                          " matrix instead of m·n)",
    "dion_momentum": "Dion's error-feedback momentum mu (default 0.95)",
    "dion_qr_method": "auto|shifted_cqr|cqr|rcqr|qr|polar orthonormalization of Dion's power iteration"
                      " (default auto: shifted_cqr, batched Cholesky QR with no loop over"
                      " matrices, on a GPU; rcqr on a CPU)",
    "dion_power_precision": "default|float32|tensorfloat32|bfloat16 inputs of Dion's power-iteration"
                            " products B Q and B^T P, accumulated in float32 (default: XLA's, TF32 on"
                            " an NVIDIA GPU, float32 on a CPU; tensorfloat32 is emulated on a CPU)",
    "dion_qr_precision": "float32|tensorfloat32x3 Grams and products of Dion's Cholesky QR passes"
                         " (shifted_cqr, cqr): IEEE float32, or three TF32 products each on an NVIDIA"
                         " GPU's tensor cores at float32's accuracy (emulated on a CPU)",
    "dion_scale_rule": "fan_ratio|spectral|max_one|none shape scale of Dion's update"
                       " (default fan_ratio, the reference's sqrt(fan_out/fan_in))",
    "dion_scalar_optimizer": "adamw|lion for embeddings, LM head and norms (default adamw)",
    "ortho_dtype": "bfloat16|float32: dtype of dion2/normuon/muon's orthogonalization (default"
                   " bfloat16, as the reference; float32 replays exactly on every mesh)",
    "dion_mixed_precision": "keep Dion's momentum and Q in bfloat16 (microsoft/dion's"
                            " mixed_precision: true; default off: the parameter's dtype)",
    "dion_split_q": "split Dion's Q (columns x r) over the mesh axes that split each matrix's rows"
                    " (tp) as well as its columns, ZeRO-style: the state's Q per device divided by tp,"
                    " for one all-gather of Q over tp per step; the update holds it whole, so the"
                    " step's peak drops only with --megabatch-mib (default off: Q replicated over tp)",
    "megabatch_mib": "step the matrix optimizer's megabatches (Dion's, Muon's, ...: each geometry's"
                     " parameters stacked) one after another, each cut into chunks of at most this many"
                     " MiB per device of gradients and state (at least one parameter): the update holds"
                     " one chunk's copy instead of every group's, the same numbers, fewer collectives in"
                     " flight at once (default 0: every megabatch at once)",
    "dion_replicate_sync": "with rp > 1 keep per-replica momentum and average only Dion's"
                           " low-rank factors over rp (default on)",
    "offload_optimizer": "keep the optimizer state (Dion's, Muon's, AdamW's, ...) in pinned host memory"
                         " between steps, moved to the device for the update only (Megatron's"
                         " --optimizer-cpu-offload, MaxText's optimizer_memory_host_offload; default off);"
                         " on CPU it changes no memory (host and device are one RAM)",
    "global_batch_size": "sequences per optimizer step over all devices (default 16)",
    "micro_batch_size": "sequences per data-parallel rank per micro-step (default: all of"
                        " them); micro-batches = global / (micro x rp x fs) feed gradient"
                        " accumulation, or the pipeline when pp > 1",
    "steps": "optimizer steps of the run, counted from its start (default 200)",
    "seed": "seed of the initialization, Dion's sketches and the data order (default 0)",
    "mesh": "device mesh, e.g. rp=1,fs=2,tp=2, over the axes rp (replicas: data parallel, Dion's"
            " momentum per replica), fs (fully sharded data parallel), ep (experts), cp (context:"
            " the sequence split), tp (tensor parallel), pp (pipeline stages); missing ones are 1;"
            " default fs=<all devices>; on CPU the trainer creates the host devices it needs",
    "log_interval": "steps between log lines (default 10)",
    "eval_every": "steps between validation evaluations, 0 for only at the end (default 100)",
    "eval_tokens": ("validation tokens per evaluation (default 16384); an sft: validation file is"
                    " evaluated whole, each example once; 0 turns validation off"),
    "tensorboard": "also write the log's metrics as TensorBoard event files into DIR (default off;"
                   " DIR defaults to RUN_DIR/tensorboard; needs the tensorboard extra)",
    "wandb": "also log the metrics and the config to this Weights & Biases project (default none;"
             " needs the wandb extra; WANDB_MODE=offline writes the run into RUN_DIR/wandb without a"
             " network)",
    "profile_steps": "A:B: trace steps A to B with jax.profiler into RUN_DIR/profile (TensorBoard's"
                     " profile plugin, Perfetto), each step named with its number (default none)",
    "config": "read flags from a YAML or JSON file (keys: these flags without dashes, e.g."
              " lr_warmup_steps: 10; or a run's config.json); flags given here override it (default: none)",
    "print_config": "print the resolved flags as YAML (a --config file) and exit",
    "name": "run name: the run directory is runs/NAME (default PRESET-OPTIMIZER, or"
            " BASENAME(DIR)-OPTIMIZER with --init-from hf:DIR, NAME-OPTIMIZER with hf:ORG/NAME)",
    "run_dir": "run directory for config.json, metrics.jsonl and checkpoints (default runs/NAME)",
    "ckpt_dir": "checkpoint directory (default RUN_DIR/checkpoints)",
    "save_every": "steps between checkpoints, 0 for only at the end (default 100)",
    "keep": "checkpoints to keep, newest first (default 2)",
    "resume": "continue from the latest complete checkpoint; flags left off keep the values"
              " saved in the run's config.json (or, without it, in the checkpoint); a new --steps"
              " keeps the saved lr schedule unless --lr-decay-steps is given",
    "step": "with --resume: continue from this checkpoint step (default: the latest; an earlier"
            " one to go back past a damaged or unwanted one); the newer checkpoints are deleted",
    "coordinator": "multi-host: HOST:PORT of process 0's coordinator, the same on every process; each"
                   " process then runs under a small agent of its own that ends it with one line when"
                   " process 0 dies (default: none, one process)",
    "num_processes": "multi-host: number of processes (default: none, one process)",
    "process_id": "multi-host: this process's index in [0, --num-processes) (default: none, one process)",
    "distributed": "multi-host with jax.distributed.initialize's auto-detection (SLURM, Open MPI, TPU)",
    "distributed_timeout": "multi-host: seconds to wait for every process to join the coordinator"
                           " (default 300)",
    "heartbeat_timeout": "multi-host: seconds after which a process whose heartbeat stopped (killed,"
                         " hung, cut off) counts as lost; every other process then ends with one line"
                         " and exit 1 (default 100, jax.distributed.initialize's heartbeat timeout)",
}

# train.grpo's own flags (train/grpo/config.py); those it shares with train.gpt (the
# optimizer, its schedule, precision, the mesh, checkpoints) take HELP's text.
GRPO_HELP = {
    "init_from": "the python -m train.gpt (or train.grpo) run to start from: its latest checkpoint is"
                 " the starting policy and, with --beta > 0, the reference (needed)",
    "prompts": "the prompts (needed): a JSONL file (one object a line), a Parquet file or a folder of"
               " them, or a Hugging Face datasets dataset saved with save_to_disk (of a DatasetDict,"
               " its train split); each row's --prompt-column text, or its chat \"messages\" rendered by"
               " --init-from's chat template, and the columns the rewards read",
    "prompt_column": "the prompts' text column (default prompt; GSM8K's is question)",
    "answer_column": "the column the built-in answer reward reads as \"answer\" (default answer)",
    "reward": "NAME[=WEIGHT] (weight 1 by default), repeatable (needed): a built-in, answer (1 where"
              " the completion's answer, after its last ####, is the row's: the text after the"
              " answer's last #### when it has one, as GSM8K's; compared without commas and a"
              " trailing period, as GSM8K's evaluation) or format (1 where the completion ends with"
              " #### and an answer), or module:function, called as TRL calls one:"
              " function(prompts=[...], completions=[...], **columns) -> one float per completion",
    "run_dir": "directory for config.json, metrics.jsonl and checkpoints (needed)",
    "steps": "GRPO steps of the run, each one rollout and --updates-per-rollout optimizer updates"
             " (default 100)",
    "seed": "seed of the prompts' order and the sampler (default 0)",
    "resume": "continue the run in --run-dir from its latest checkpoint (or --step) with the flags"
              " saved in its config.json; only --steps, --save-every, --keep, --mesh,"
              " --micro-batch-size, --max-skipped, the memory flags (--remat, --offload-optimizer,"
              " --loss-chunk, --dion-split-q, --megabatch-mib), --tensorboard, --wandb and the"
              " multi-host flags may change",
    "prompts_per_step": "prompts of each rollout, in a seeded order, epoch after epoch (default 8)",
    "group_size": "completions of each prompt, G >= 2 (default 8; TRL's num_generations)",
    "max_new_tokens": "most tokens of a completion (default 64; TRL's max_completion_length)",
    "temperature": "sampling temperature, > 0; the log-probabilities are those of softmax(logits / T)"
                   " (default 1.0)",
    "top_k": "sample among the K likeliest tokens only (default: all)",
    "top_p": "sample among the likeliest tokens whose probability reaches P only, in (0, 1] (default 1: all)",
    "updates_per_rollout": "optimizer updates on each rollout, each on all of it (default 1; also"
                           " --num-iterations, TRL's name: its mu with steps_per_generation equal to"
                           " gradient_accumulation_steps, TRL's default)",
    "pack": "pack the update's completions, each after its prompt, several to a row (segment ids"
            " keep attention within each, positions restart), as train.gpt packs sft: data; rows as"
            " long as --no-pack's, at most the model's seq_len (default on; --no-pack: one"
            " completion to a row, the prompt left-padded to the longest's power of two)",
    "loss_type": "grpo|bnpo|dr_grpo|dapo|cispo|sapo|luspo|vespo, TRL 1.16's: the clipped ratio"
                 " averaged per sequence, over the batch's tokens, over B x --max-new-tokens or over the"
                 " rollout's tokens; cispo the policy gradient weighted by the ratio capped at"
                 " --epsilon-high (MiniMax-M1), over the rollout's tokens; sapo a soft gate instead of"
                 " the clip (Soft Adaptive Policy Optimization), per sequence; luspo the clipped ratio"
                 " summed over each sequence, averaged over sequences (LUSPO; meant with"
                 " --importance-sampling-level sequence); vespo the policy gradient weighted by a gamma"
                 " function of the sequence's ratio (VESPO; --vespo-*), over the rollout's tokens"
                 " (default dapo)",
    "importance_sampling_level": "token|sequence: the ratio to the rollout's policy per token, or"
                                 " for every token of a completion the geometric mean of its"
                                 " tokens' (GSPO) (default token)",
    "epsilon_low": "lower clip of the ratio: 1 - epsilon (default 0.2; TRL's epsilon)",
    "epsilon_high": "upper clip of the ratio: 1 + epsilon (default 0.28, DAPO's clip-higher); with"
                    " --loss-type cispo the cap on the ratio itself (ScaleRL recommends 5.0)",
    "beta": "weight of the k3 KL to the starting policy (default 0: no reference kept)",
    "use_bias_correction_kl": "multiply the KL term by the ratio, for the unbiased reverse-KL gradient"
                              " (DeepSeek-V3.2; default on, as TRL's)",
    "scale_rewards": "group|batch|none: divide each advantage by the rewards' std within its"
                     " prompt's group, over the rollout, or not at all (default group)",
    "multi_objective_aggregation": "sum_then_normalize|normalize_then_sum: with several rewards,"
                                   " weight and sum them, then center within each group"
                                   " (--scale-rewards); or normalize each within its group first,"
                                   " then sum and normalize over the rollout (GDPO)"
                                   " (default sum_then_normalize)",
    "top_entropy_quantile": "the policy loss counts on the tokens whose entropy is in this top"
                            " quantile of the rollout's only, in [0, 1] (default 1: all; Beyond the"
                            " 80/20 Rule recommends 0.2)",
    "sapo_temperature_pos": "--loss-type sapo: the gate's temperature on tokens of positive advantage"
                            " (default 1.0)",
    "sapo_temperature_neg": "--loss-type sapo: the gate's temperature on the other tokens (default 1.05)",
    "delta": "two-sided clipping (INTELLECT-2): the ratio is also capped at DELTA > 1 where the"
             " advantage is negative, recommended above 1 + --epsilon-high (default: none)",
    "off_policy_mask_threshold": "OPSM (DeepSeek-V3.2): a completion of negative advantage whose mean"
                                 " log-ratio of the rollout's policy to the current one exceeds this"
                                 " positive threshold counts nothing, e.g. 0.5 (default: none)",
    "vespo_k_pos": "--loss-type vespo: the gamma weight's power k where the advantage is >= 0: how"
                   " fast sequences of ratio below 1 lose weight (default 2.0)",
    "vespo_lambda_pos": "--loss-type vespo: the gamma weight's decay lambda where the advantage is"
                        " >= 0: how fast sequences of ratio above 1 lose weight (default 3.0)",
    "vespo_k_neg": "--loss-type vespo: k where the advantage is negative (default 3.0)",
    "vespo_lambda_neg": "--loss-type vespo: lambda where the advantage is negative (default 2.0)",
    "entropy_coef": "subtract this times the policy's mean entropy over the completion tokens (those"
                    " of --top-entropy-quantile's mask) from the loss: an entropy bonus for exploration,"
                    " the same for every --loss-type; with --use-adaptive-entropy its starting value"
                    " (default 0: none)",
    "use_adaptive_entropy": "adaptive entropy control (Skywork-OR1): the bonus applies only while the"
                            " entropy at the previous update is at most --entropy-target, and its"
                            " coefficient moves by --entropy-coef-delta after each update, up where"
                            " the entropy was at most the target, down elsewhere",
    "entropy_coef_min": "--use-adaptive-entropy: the coefficient's floor (default 0.0)",
    "entropy_coef_max": "--use-adaptive-entropy: the coefficient's ceiling (default 1.0)",
    "entropy_coef_delta": "--use-adaptive-entropy: the coefficient's step per update (default 0.005)",
    "entropy_target": "--use-adaptive-entropy: the mean entropy (nats) at or below which the bonus"
                      " applies and grows (default 0.2)",
}
