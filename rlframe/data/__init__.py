"""Data: prompt datasets (parquet/jsonl, verl layout), the resumable dataloader, synthetic tasks,
and the tiny model (char tokenizer, Qwen2 presets, brief SFT pre-training with a disk cache).

Modules: `dataset` (PromptDataset), `dataloader` (StatefulDataLoader, collate, to_dataproto),
`synthetic` (arithmetic/countdown generators; `python -m rlframe.data.synthetic`), `tokenizer`,
`tiny_model` (build_random_model, PRESETS), `pretrain` (build_pretrained_model), `shipped` (the
pre-trained demo model kept in `presets/`, verified and copied instead of built), `tiny_eval`.
Imported lazily by module so that `import rlframe.data` stays free of torch/transformers.
"""
