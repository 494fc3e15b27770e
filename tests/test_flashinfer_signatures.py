"""Every public attention function and wrapper method takes FlashInfer 0.5.3's parameters: names, order, defaults.

The reference lists below were read off FlashInfer 0.5.3's Python sources (its ``decode``,
``prefill``, ``cascade``, ``page``, ``rope``, ``norm``, ``activation``, ``mla``, ``attention``, ``sparse`` and ``pod``
modules; the attention-sink wrapper's
``plan``/``run`` are the paged prefill wrapper's, which it inherits; ``self`` dropped, ``*args`` kept). The rule a
drop-in replacement must follow, checked with ``inspect.signature``:

- every FlashInfer parameter exists, of the same kind (positional vs keyword-only);
- the positional ones come in FlashInfer's order;
- a FlashInfer default is kept exactly (a parameter FlashInfer requires may have a default here);
- parameters jitattn adds have defaults and come after all of FlashInfer's, or are keyword-only.
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch  # noqa: F401  (FlashInfer defaults such as torch.bfloat16 are evaluated below)

FLASHINFER_0_5_3 = {
    'norm.rmsnorm': [('input', None), ('weight', None), ('eps', '1e-06'), ('out', 'None'), ('enable_pdl', 'None')],
    'norm.fused_add_rmsnorm': [
        ('input', None), ('residual', None), ('weight', None), ('eps', '1e-06'), ('enable_pdl', 'None')
    ],
    'norm.gemma_rmsnorm': [('input', None), ('weight', None), ('eps', '1e-06'), ('out', 'None'), ('enable_pdl', 'None')],
    'norm.gemma_fused_add_rmsnorm': [
        ('input', None), ('residual', None), ('weight', None), ('eps', '1e-06'), ('enable_pdl', 'None')
    ],
    'activation.silu_and_mul': [('input', None), ('out', 'None'), ('enable_pdl', 'None')],
    'activation.gelu_and_mul': [('input', None), ('out', 'None'), ('enable_pdl', 'None')],
    'activation.gelu_tanh_and_mul': [('input', None), ('out', 'None'), ('enable_pdl', 'None')],
    'mla.BatchMLAPagedAttentionWrapper.__init__': [
        ('float_workspace_buffer', None), ('use_cuda_graph', 'False'), ('qo_indptr', 'None'), ('kv_indptr', 'None'),
        ('kv_indices', 'None'), ('kv_len_arr', 'None'), ('backend', "'auto'")
    ],
    'mla.BatchMLAPagedAttentionWrapper.plan': [
        ('qo_indptr', None), ('kv_indptr', None), ('kv_indices', None), ('kv_len_arr', None), ('num_heads', None),
        ('head_dim_ckv', None), ('head_dim_kpe', None), ('page_size', None), ('causal', None), ('sm_scale', None),
        ('q_data_type', None), ('kv_data_type', None), ('use_profiler', 'False')
    ],
    'mla.BatchMLAPagedAttentionWrapper.run': [
        ('q_nope', None), ('q_pe', None), ('ckv_cache', None), ('kpe_cache', None), ('out', 'None'), ('lse', 'None'),
        ('return_lse', 'False'), ('profiler_buffer', 'None'), ('kv_len', 'None'), ('page_table', 'None'),
        ('return_lse_base_on_e', 'False')
    ],
    'page.append_paged_mla_kv_cache': [
        ('append_ckv', None), ('append_kpe', None), ('batch_indices', None), ('positions', None), ('ckv_cache', None),
        ('kpe_cache', None), ('kv_indices', None), ('kv_indptr', None), ('kv_last_page_len', None)
    ],
    'decode.single_decode_with_kv_cache': [
        ('q', None), ('k', None), ('v', None), ('kv_layout', "'NHD'"), ('pos_encoding_mode', "'NONE'"),
        ('use_tensor_cores', 'False'), ('q_scale', 'None'), ('k_scale', 'None'), ('v_scale', 'None'),
        ('window_left', '-1'), ('logits_soft_cap', 'None'), ('sm_scale', 'None'), ('rope_scale', 'None'),
        ('rope_theta', 'None'), ('return_lse', 'False')
    ],
    'decode.fast_decode_plan': [
        ('indptr', None), ('indices', None), ('last_page_len', None), ('num_qo_heads', None), ('num_kv_heads',
        None), ('head_dim', None), ('page_size', None), ('pos_encoding_mode', "'NONE'"), ('window_left', '-1'),
        ('logits_soft_cap', 'None'), ('q_data_type', 'None'), ('kv_data_type', 'None'), ('data_type', 'None'),
        ('sm_scale', 'None'), ('rope_scale', 'None'), ('rope_theta', 'None'), ('non_blocking', 'True'),
        ('fixed_split_size', 'None'), ('disable_split_kv', 'False'), ('global_override_indptr_cpu', 'None')
    ],
    'decode.BatchDecodeWithPagedKVCacheWrapper.__init__': [
        ('float_workspace_buffer', None), ('kv_layout', "'NHD'"), ('use_cuda_graph', 'False'), ('use_tensor_cores',
        'False'), ('paged_kv_indptr_buffer', 'None'), ('paged_kv_indices_buffer', 'None'),
        ('paged_kv_last_page_len_buffer', 'None'), ('backend', "'auto'"), ('jit_args', 'None')
    ],
    'decode.BatchDecodeWithPagedKVCacheWrapper.plan': [
        ('indptr', None), ('indices', None), ('last_page_len', None), ('num_qo_heads', None), ('num_kv_heads',
        None), ('head_dim', None), ('page_size', None), ('pos_encoding_mode', "'NONE'"), ('window_left', '-1'),
        ('logits_soft_cap', 'None'), ('q_data_type', "'float16'"), ('kv_data_type', 'None'), ('data_type', 'None'),
        ('sm_scale', 'None'), ('rope_scale', 'None'), ('rope_theta', 'None'), ('non_blocking', 'True'),
        ('block_tables', 'None'), ('seq_lens', 'None'), ('fixed_split_size', 'None'), ('disable_split_kv', 'False')
    ],
    'decode.BatchDecodeWithPagedKVCacheWrapper.run': [
        ('q', None), ('paged_kv_cache', None), ('*args', None), ('q_scale', 'None'), ('k_scale', 'None'),
        ('v_scale', 'None'), ('out', 'None'), ('lse', 'None'), ('return_lse', 'False'), ('enable_pdl', 'None'),
        ('window_left', 'None'), ('sinks', 'None'), ('q_len_per_req', '1')
    ],
    'decode.BatchDecodeWithPagedKVCacheWrapper.forward': [
        ('q', None), ('paged_kv_cache', None), ('pos_encoding_mode', "'NONE'"), ('q_scale', 'None'), ('k_scale',
        'None'), ('v_scale', 'None'), ('window_left', '-1'), ('logits_soft_cap', 'None'), ('sm_scale', 'None'),
        ('rope_scale', 'None'), ('rope_theta', 'None')
    ],
    'decode.BatchDecodeWithPagedKVCacheWrapper.forward_return_lse': [
        ('q', None), ('paged_kv_cache', None), ('pos_encoding_mode', "'NONE'"), ('q_scale', 'None'), ('k_scale',
        'None'), ('v_scale', 'None'), ('window_left', '-1'), ('logits_soft_cap', 'None'), ('sm_scale', 'None'),
        ('rope_scale', 'None'), ('rope_theta', 'None')
    ],
    'decode.BatchDecodeWithPagedKVCacheWrapper.reset_workspace_buffer': [
        ('float_workspace_buffer', None), ('int_workspace_buffer', None)
    ],
    'decode.CUDAGraphBatchDecodeWithPagedKVCacheWrapper.__init__': [
        ('workspace_buffer', None), ('indptr_buffer', None), ('indices_buffer', None), ('last_page_len_buffer',
        None), ('kv_layout', "'NHD'"), ('use_tensor_cores', 'False')
    ],
    'prefill.single_prefill_with_kv_cache': [
        ('q', None), ('k', None), ('v', None), ('scale_q', 'None'), ('scale_k', 'None'), ('scale_v', 'None'),
        ('o_dtype', 'None'), ('custom_mask', 'None'), ('packed_custom_mask', 'None'), ('causal', 'False'),
        ('kv_layout', "'NHD'"), ('pos_encoding_mode', "'NONE'"), ('use_fp16_qk_reduction', 'False'), ('sm_scale',
        'None'), ('window_left', '-1'), ('logits_soft_cap', 'None'), ('rope_scale', 'None'), ('rope_theta', 'None'),
        ('backend', "'auto'"), ('return_lse', 'False')
    ],
    'prefill.BatchPrefillWithPagedKVCacheWrapper.__init__': [
        ('float_workspace_buffer', None), ('kv_layout', "'NHD'"), ('use_cuda_graph', 'False'), ('qo_indptr_buf',
        'None'), ('paged_kv_indptr_buf', 'None'), ('paged_kv_indices_buf', 'None'), ('paged_kv_last_page_len_buf',
        'None'), ('custom_mask_buf', 'None'), ('mask_indptr_buf', 'None'), ('backend', "'auto'"), ('jit_args',
        'None'), ('jit_kwargs', 'None')
    ],
    'prefill.BatchPrefillWithPagedKVCacheWrapper.plan': [
        ('qo_indptr', None), ('paged_kv_indptr', None), ('paged_kv_indices', None), ('paged_kv_last_page_len',
        None), ('num_qo_heads', None), ('num_kv_heads', None), ('head_dim_qk', None), ('page_size', None),
        ('head_dim_vo', 'None'), ('custom_mask', 'None'), ('packed_custom_mask', 'None'), ('causal', 'False'),
        ('pos_encoding_mode', "'NONE'"), ('use_fp16_qk_reduction', 'False'), ('sm_scale', 'None'), ('window_left',
        '-1'), ('logits_soft_cap', 'None'), ('rope_scale', 'None'), ('rope_theta', 'None'), ('q_data_type',
        "'float16'"), ('kv_data_type', 'None'), ('non_blocking', 'True'), ('prefix_len_ptr', 'None'),
        ('token_pos_in_items_ptr', 'None'), ('token_pos_in_items_len', '0'), ('max_item_len_ptr', 'None'),
        ('seq_lens', 'None'), ('seq_lens_q', 'None'), ('block_tables', 'None'), ('max_token_per_sequence', 'None'),
        ('max_sequence_kv', 'None'), ('fixed_split_size', 'None'), ('disable_split_kv', 'False')
    ],
    'prefill.BatchPrefillWithPagedKVCacheWrapper.run': [
        ('q', None), ('paged_kv_cache', None), ('*args', None), ('q_scale', 'None'), ('k_scale', 'None'),
        ('v_scale', 'None'), ('out', 'None'), ('lse', 'None'), ('return_lse', 'False'), ('enable_pdl', 'None'),
        ('window_left', 'None'), ('sinks', 'None')
    ],
    'prefill.BatchPrefillWithPagedKVCacheWrapper.forward': [
        ('q', None), ('paged_kv_cache', None), ('causal', 'False'), ('pos_encoding_mode', "'NONE'"),
        ('use_fp16_qk_reduction', 'False'), ('k_scale', 'None'), ('v_scale', 'None'), ('window_left', '-1'),
        ('logits_soft_cap', 'None'), ('sm_scale', 'None'), ('rope_scale', 'None'), ('rope_theta', 'None')
    ],
    'prefill.BatchPrefillWithPagedKVCacheWrapper.forward_return_lse': [
        ('q', None), ('paged_kv_cache', None), ('causal', 'False'), ('pos_encoding_mode', "'NONE'"),
        ('use_fp16_qk_reduction', 'False'), ('k_scale', 'None'), ('v_scale', 'None'), ('window_left', '-1'),
        ('logits_soft_cap', 'None'), ('sm_scale', 'None'), ('rope_scale', 'None'), ('rope_theta', 'None')
    ],
    'prefill.BatchPrefillWithPagedKVCacheWrapper.reset_workspace_buffer': [
        ('float_workspace_buffer', None), ('int_workspace_buffer', None)
    ],
    'prefill.BatchPrefillWithRaggedKVCacheWrapper.__init__': [
        ('float_workspace_buffer', None), ('kv_layout', "'NHD'"), ('use_cuda_graph', 'False'), ('qo_indptr_buf',
        'None'), ('kv_indptr_buf', 'None'), ('custom_mask_buf', 'None'), ('mask_indptr_buf', 'None'), ('backend',
        "'auto'"), ('jit_args', 'None'), ('jit_kwargs', 'None')
    ],
    'prefill.BatchPrefillWithRaggedKVCacheWrapper.plan': [
        ('qo_indptr', None), ('kv_indptr', None), ('num_qo_heads', None), ('num_kv_heads', None), ('head_dim_qk',
        None), ('head_dim_vo', 'None'), ('custom_mask', 'None'), ('packed_custom_mask', 'None'), ('causal',
        'False'), ('pos_encoding_mode', "'NONE'"), ('use_fp16_qk_reduction', 'False'), ('window_left', '-1'),
        ('logits_soft_cap', 'None'), ('sm_scale', 'None'), ('rope_scale', 'None'), ('rope_theta', 'None'),
        ('q_data_type', "'float16'"), ('kv_data_type', 'None'), ('non_blocking', 'True'), ('prefix_len_ptr',
        'None'), ('token_pos_in_items_ptr', 'None'), ('token_pos_in_items_len', '0'), ('max_item_len_ptr', 'None'),
        ('fixed_split_size', 'None'), ('disable_split_kv', 'False')
    ],
    'prefill.BatchPrefillWithRaggedKVCacheWrapper.run': [
        ('q', None), ('k', None), ('v', None), ('*args', None), ('out', 'None'), ('lse', 'None'), ('return_lse',
        'False'), ('enable_pdl', 'None')
    ],
    'prefill.BatchPrefillWithRaggedKVCacheWrapper.forward': [
        ('q', None), ('k', None), ('v', None), ('causal', 'False'), ('pos_encoding_mode', "'NONE'"),
        ('use_fp16_qk_reduction', 'False'), ('window_left', '-1'), ('logits_soft_cap', 'None'), ('sm_scale',
        'None'), ('rope_scale', 'None'), ('rope_theta', 'None')
    ],
    'prefill.BatchPrefillWithRaggedKVCacheWrapper.forward_return_lse': [
        ('q', None), ('k', None), ('v', None), ('causal', 'False'), ('pos_encoding_mode', "'NONE'"),
        ('use_fp16_qk_reduction', 'False'), ('window_left', '-1'), ('logits_soft_cap', 'None'), ('sm_scale',
        'None'), ('rope_scale', 'None'), ('rope_theta', 'None')
    ],
    'prefill.BatchPrefillWithRaggedKVCacheWrapper.reset_workspace_buffer': [
        ('float_workspace_buffer', None), ('int_workspace_buffer', None)
    ],
    'cascade.merge_state': [
        ('v_a', None), ('s_a', None), ('v_b', None), ('s_b', None)
    ],
    'cascade.merge_state_in_place': [
        ('v', None), ('s', None), ('v_other', None), ('s_other', None), ('mask', 'None')
    ],
    'cascade.merge_states': [
        ('v', None), ('s', None)
    ],
    'cascade.MultiLevelCascadeAttentionWrapper.__init__': [
        ('num_levels', None), ('float_workspace_buffer', None), ('kv_layout', "'NHD'"), ('use_cuda_graph', 'False'),
        ('qo_indptr_buf_arr', 'None'), ('paged_kv_indptr_buf_arr', 'None'), ('paged_kv_indices_buf_arr', 'None'),
        ('paged_kv_last_page_len_buf_arr', 'None')
    ],
    'cascade.MultiLevelCascadeAttentionWrapper.plan': [
        ('qo_indptr_arr', None), ('paged_kv_indptr_arr', None), ('paged_kv_indices_arr', None),
        ('paged_kv_last_page_len', None), ('num_qo_heads', None), ('num_kv_heads', None), ('head_dim', None),
        ('page_size', None), ('causal', 'False'), ('pos_encoding_mode', "'NONE'"), ('use_fp16_qk_reduction',
        'False'), ('sm_scale', 'None'), ('window_left', '-1'), ('logits_soft_cap', 'None'), ('rope_scale', 'None'),
        ('rope_theta', 'None'), ('q_data_type', "'float16'"), ('kv_data_type', 'None')
    ],
    'cascade.MultiLevelCascadeAttentionWrapper.run': [
        ('q', None), ('paged_kv_cache', None)
    ],
    'cascade.MultiLevelCascadeAttentionWrapper.reset_workspace_buffer': [
        ('float_workspace_buffer', None), ('int_workspace_buffers', None)
    ],
    'cascade.BatchDecodeWithSharedPrefixPagedKVCacheWrapper.__init__': [
        ('float_workspace_buffer', None), ('kv_layout', "'NHD'")
    ],
    'cascade.BatchDecodeWithSharedPrefixPagedKVCacheWrapper.begin_forward': [
        ('unique_kv_indptr', None), ('unique_kv_indices', None), ('unique_kv_last_page_len', None), ('num_qo_heads',
        None), ('num_kv_heads', None), ('head_dim', None), ('page_size', None), ('data_type', "'float16'")
    ],
    'cascade.BatchDecodeWithSharedPrefixPagedKVCacheWrapper.forward': [
        ('q', None), ('k_shared', None), ('v_shared', None), ('unique_kv_cache', None)
    ],
    'cascade.BatchDecodeWithSharedPrefixPagedKVCacheWrapper.reset_workspace_buffer': [
        ('float_workspace_buffer', None), ('int_workspace_buffer', None)
    ],
    'cascade.BatchPrefillWithSharedPrefixPagedKVCacheWrapper.__init__': [
        ('float_workspace_buffer', None), ('kv_layout', "'NHD'")
    ],
    'cascade.BatchPrefillWithSharedPrefixPagedKVCacheWrapper.begin_forward': [
        ('qo_indptr', None), ('paged_kv_indptr', None), ('paged_kv_indices', None), ('paged_kv_last_page_len',
        None), ('num_qo_heads', None), ('num_kv_heads', None), ('head_dim', None), ('page_size', None)
    ],
    'cascade.BatchPrefillWithSharedPrefixPagedKVCacheWrapper.forward': [
        ('q', None), ('k_shared', None), ('v_shared', None), ('unique_kv_cache', None), ('causal', 'False'),
        ('use_fp16_qk_reduction', 'False'), ('sm_scale', 'None'), ('rope_scale', 'None'), ('rope_theta', 'None')
    ],
    'cascade.BatchPrefillWithSharedPrefixPagedKVCacheWrapper.reset_workspace_buffer': [
        ('float_workspace_buffer', None), ('int_workspace_buffer', None)
    ],
    'attention.BatchAttentionWithAttentionSinkWrapper.__init__': [
        ('float_workspace_buffer', None), ('kv_layout', "'NHD'"), ('use_cuda_graph', 'False'), ('qo_indptr_buf',
        'None'), ('paged_kv_indptr_buf', 'None'), ('paged_kv_indices_buf', 'None'), ('paged_kv_last_page_len_buf',
        'None'), ('custom_mask_buf', 'None'), ('mask_indptr_buf', 'None'), ('backend', "'auto'"),
        ('pos_encoding_mode', "'NONE'"), ('use_fp16_qk_reduction', 'False'), ('q_data_type', 'torch.bfloat16'),
        ('kv_data_type', 'torch.bfloat16'), ('head_dim_qk', '128'), ('head_dim_vo', '128'), ('window_left', '-1')
    ],
    'attention.BatchAttentionWithAttentionSinkWrapper.plan': [
        ('qo_indptr', None), ('paged_kv_indptr', None), ('paged_kv_indices', None), ('paged_kv_last_page_len',
        None), ('num_qo_heads', None), ('num_kv_heads', None), ('head_dim_qk', None), ('page_size', None),
        ('head_dim_vo', 'None'), ('custom_mask', 'None'), ('packed_custom_mask', 'None'), ('causal', 'False'),
        ('pos_encoding_mode', "'NONE'"), ('use_fp16_qk_reduction', 'False'), ('sm_scale', 'None'), ('window_left',
        '-1'), ('logits_soft_cap', 'None'), ('rope_scale', 'None'), ('rope_theta', 'None'), ('q_data_type',
        "'float16'"), ('kv_data_type', 'None'), ('non_blocking', 'True'), ('prefix_len_ptr', 'None'),
        ('token_pos_in_items_ptr', 'None'), ('token_pos_in_items_len', '0'), ('max_item_len_ptr', 'None'),
        ('seq_lens', 'None'), ('seq_lens_q', 'None'), ('block_tables', 'None'), ('max_token_per_sequence', 'None'),
        ('max_sequence_kv', 'None'), ('fixed_split_size', 'None'), ('disable_split_kv', 'False')
    ],
    'attention.BatchAttentionWithAttentionSinkWrapper.run': [
        ('q', None), ('paged_kv_cache', None), ('*args', None), ('q_scale', 'None'), ('k_scale', 'None'),
        ('v_scale', 'None'), ('out', 'None'), ('lse', 'None'), ('return_lse', 'False'), ('enable_pdl', 'None'),
        ('window_left', 'None'), ('sinks', 'None')
    ],
    'page.append_paged_kv_cache': [
        ('append_key', None), ('append_value', None), ('batch_indices', None), ('positions', None),
        ('paged_kv_cache', None), ('kv_indices', None), ('kv_indptr', None), ('kv_last_page_len', None),
        ('kv_layout', "'NHD'")
    ],
    'page.get_batch_indices_positions': [
        ('append_indptr', None), ('seq_lens', None), ('nnz', None)
    ],
    'page.get_seq_lens': [
        ('kv_indptr', None), ('kv_last_page_len', None), ('page_size', None)
    ],
    **{f'rope.apply_rope{suffix}': [
        ('q', None), ('k', None), ('indptr', None), ('offsets', None), ('rotary_dim', 'None'),
        ('interleave', 'False'), ('rope_scale', '1'), ('rope_theta', '1e4')
    ] for suffix in ('', '_inplace')},
    **{f'rope.apply_rope_pos_ids{suffix}': [
        ('q', None), ('k', None), ('pos_ids', None), ('rotary_dim', 'None'), ('interleave', 'False'),
        ('rope_scale', '1'), ('rope_theta', '1e4')
    ] for suffix in ('', '_inplace')},
    **{f'rope.apply_llama31_rope{suffix}': [
        ('q', None), ('k', None), ('indptr', None), ('offsets', None), ('rotary_dim', 'None'),
        ('interleave', 'False'), ('rope_scale', '8'), ('rope_theta', '5e5'), ('low_freq_factor', '1'),
        ('high_freq_factor', '4'), ('old_context_len', '8192')
    ] for suffix in ('', '_inplace')},
    **{f'rope.apply_llama31_rope_pos_ids{suffix}': [
        ('q', None), ('k', None), ('pos_ids', None), ('rotary_dim', 'None'), ('interleave', 'False'),
        ('rope_scale', '8'), ('rope_theta', '5e5'), ('low_freq_factor', '1'), ('high_freq_factor', '4'),
        ('old_context_len', '8192')
    ] for suffix in ('', '_inplace')},
    **{f'rope.apply_rope_with_cos_sin_cache{suffix}': [
        ('positions', None), ('query', None), ('key', None), ('head_size', None), ('cos_sin_cache', None),
        ('is_neox', 'True')
    ] for suffix in ('', '_inplace')},
    'sparse.BlockSparseAttentionWrapper.__init__': [('float_workspace_buffer', None), ('backend', "'auto'")],
    'sparse.BlockSparseAttentionWrapper.reset_workspace_buffer': [
        ('float_workspace_buffer', None), ('int_workspace_buffer', None), ('vector_sparse_indices_buffer', 'None'),
        ('vector_sparse_indptr_buffer', 'None')
    ],
    'sparse.BlockSparseAttentionWrapper.plan': [
        ('indptr', None), ('indices', None), ('M', None), ('N', None), ('R', None), ('C', None), ('num_qo_heads', None),
        ('num_kv_heads', None), ('head_dim', None), ('mask', 'None'), ('packed_mask', 'None'), ('causal', 'False'),
        ('pos_encoding_mode', "'NONE'"), ('use_fp16_qk_reduction', 'False'), ('logits_soft_cap', 'None'),
        ('sm_scale', 'None'), ('rope_scale', 'None'), ('rope_theta', 'None'), ('q_data_type', "'float16'"),
        ('kv_data_type', 'None'), ('o_data_type', "'float16'"), ('non_blocking', 'True')
    ],
    'sparse.BlockSparseAttentionWrapper.forward': [
        ('q', None), ('k', None), ('v', None), ('scale_q', 'None'), ('scale_k', 'None'), ('scale_v', 'None'),
        ('pos_encoding_mode', "'NONE'"), ('use_fp16_qk_reduction', 'False'), ('logits_soft_cap', 'None'),
        ('sm_scale', 'None'), ('rope_scale', 'None'), ('rope_theta', 'None')
    ],
    'sparse.BlockSparseAttentionWrapper.run': [
        ('q', None), ('k', None), ('v', None), ('scale_q', 'None'), ('scale_k', 'None'), ('scale_v', 'None'),
        ('out', 'None'), ('lse', 'None'), ('return_lse', 'False'), ('enable_pdl', 'None')
    ],
    'sparse.VariableBlockSparseAttentionWrapper.__init__': [('float_workspace_buffer', None), ('backend', "'auto'")],
    'sparse.VariableBlockSparseAttentionWrapper.reset_workspace_buffer': [
        ('float_workspace_buffer', None), ('int_workspace_buffer', None), ('vector_sparse_indices_buffer', 'None'),
        ('vector_sparse_indptr_buffer', 'None')
    ],
    'sparse.VariableBlockSparseAttentionWrapper.plan': [
        ('block_mask_map', None), ('block_row_sz', None), ('block_col_sz', None), ('num_qo_heads', None),
        ('num_kv_heads', None), ('head_dim', None), ('causal', 'False'), ('pos_encoding_mode', "'NONE'"),
        ('use_fp16_qk_reduction', 'False'), ('logits_soft_cap', 'None'), ('sm_scale', 'None'), ('rope_scale', 'None'),
        ('rope_theta', 'None'), ('non_blocking', 'True'), ('q_data_type', "'float16'"), ('kv_data_type', 'None')
    ],
    'sparse.VariableBlockSparseAttentionWrapper.forward': [
        ('q', None), ('k', None), ('v', None), ('pos_encoding_mode', "'NONE'"), ('use_fp16_qk_reduction', 'False'),
        ('logits_soft_cap', 'None'), ('sm_scale', 'None'), ('rope_scale', 'None'), ('rope_theta', 'None')
    ],
    'sparse.VariableBlockSparseAttentionWrapper.run': [
        ('q', None), ('k', None), ('v', None), ('out', 'None'), ('lse', 'None'), ('return_lse', 'False'),
        ('enable_pdl', 'None')
    ],
    'attention.BatchAttention.__init__': [('kv_layout', "'NHD'"), ('device', "'cuda'")],
    'attention.BatchAttention.plan': [
        ('qo_indptr', None), ('kv_indptr', None), ('kv_indices', None), ('kv_len_arr', None), ('num_qo_heads', None),
        ('num_kv_heads', None), ('head_dim_qk', None), ('head_dim_vo', None), ('page_size', None), ('causal', 'False'),
        ('sm_scale', 'None'), ('logits_soft_cap', 'None'), ('q_data_type', 'torch.bfloat16'),
        ('kv_data_type', 'torch.bfloat16'), ('use_profiler', 'False')
    ],
    'attention.BatchAttention.run': [
        ('q', None), ('kv_cache', None), ('out', 'None'), ('lse', 'None'), ('k_scale', 'None'), ('v_scale', 'None'),
        ('logits_soft_cap', '0.0'), ('profiler_buffer', 'None')
    ],
    'pod.PODWithPagedKVCacheWrapper.__init__': [
        ('float_workspace_buffer', None), ('kv_layout', "'NHD'"), ('use_cuda_graph', 'False'),
        ('paged_kv_indptr_buffer', 'None'), ('paged_kv_indices_buffer', 'None'),
        ('paged_kv_last_page_len_buffer', 'None'), ('jit_args', 'None')
    ],
    'pod.PODWithPagedKVCacheWrapper.reset_workspace_buffer': [
        ('float_workspace_buffer', None), ('int_workspace_buffer', None)
    ],
    'pod.PODWithPagedKVCacheWrapper.plan': [
        ('indptr', None), ('indices', None), ('last_page_len', None), ('num_qo_heads', None), ('num_kv_heads', None),
        ('head_dim', None), ('page_size', None), ('pos_encoding_mode', "'NONE'"), ('window_left', '-1'),
        ('q_data_type', "'float16'"), ('kv_data_type', 'None'), ('data_type', 'None'), ('sm_scale', 'None'),
        ('rope_scale', 'None'), ('rope_theta', 'None'), ('non_blocking', 'True')
    ],
    'pod.PODWithPagedKVCacheWrapper.run': [
        ('q_p', None), ('k_p', None), ('v_p', None), ('q_d', None), ('paged_kv_cache_d', None),
        ('custom_mask_p', 'None'), ('packed_custom_mask_p', 'None'), ('causal_p', 'False'), ('kv_layout_p', "'NHD'"),
        ('pos_encoding_mode_p', "'NONE'"), ('sm_scale_p', 'None'), ('window_left_p', '-1'), ('rope_scale_p', 'None'),
        ('rope_theta_p', 'None'), ('return_lse_p', 'False'), ('custom_mask_d', 'None'),
        ('packed_custom_mask_d', 'None'), ('causal_d', 'False'), ('kv_layout_d', "'NHD'"),
        ('pos_encoding_mode_d', "'NONE'"), ('sm_scale_d', 'None'), ('window_left_d', '-1'), ('rope_scale_d', 'None'),
        ('rope_theta_d', 'None'), ('q_scale', 'None'), ('k_scale', 'None'), ('v_scale', 'None'),
        ('return_lse_d', 'False'), ('use_fp16_qk_reduction', 'False'), ('enable_pdl', 'None'), ('*args', None)
    ],
    'pod.BatchPODWithPagedKVCacheWrapper.__init__': [('float_workspace_buffer', None), ('kv_layout', "'NHD'")],
    'pod.BatchPODWithPagedKVCacheWrapper.plan': [
        ('qo_indptr_p', None), ('kv_indptr_p', None), ('kv_indices_p', None), ('last_page_len_p', None),
        ('qo_indptr_d', None), ('kv_indptr_d', None), ('kv_indices_d', None), ('last_page_len_d', None),
        ('num_qo_heads', None), ('num_kv_heads', None), ('head_dim', None), ('page_size', None),
        ('pos_encoding_mode', "'NONE'"), ('window_left', '-1'), ('q_data_type', "'float16'"), ('kv_data_type', 'None'),
        ('data_type', 'None'), ('sm_scale', 'None'), ('rope_scale', 'None'), ('rope_theta', 'None'),
        ('non_blocking', 'True')
    ],
    'pod.BatchPODWithPagedKVCacheWrapper.run': [
        ('q_p', None), ('paged_kv_cache_p', None), ('q_d', None), ('paged_kv_cache_d', None),
        ('custom_mask_p', 'None'), ('packed_custom_mask_p', 'None'), ('causal_p', 'False'), ('q_scale', 'None'),
        ('k_scale', 'None'), ('v_scale', 'None'), ('return_lse', 'False'), ('use_fp16_qk_reduction', 'False'),
        ('enable_pdl', 'None')
    ],
}


# The native API and the FlashInfer-convention namespace (base-2 LSE) take the same arguments.
NAMESPACES = ["jitattn", "jitattn.flashinfer"]


def _resolve(path: str, namespace: str = "jitattn"):
    module_name, *attrs = path.split(".")
    obj = importlib.import_module(f"{namespace}.{module_name}")
    for attr in attrs:
        obj = getattr(obj, attr)
    return obj


def _ours(path: str, namespace: str) -> list[inspect.Parameter]:
    params = list(inspect.signature(_resolve(path, namespace)).parameters.values())
    if path.endswith("fast_decode_plan") or "." in path.split(".", 1)[1]:
        params = params[1:]  # the wrapper (self)
    return params


@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize("path", sorted(FLASHINFER_0_5_3))
def test_signature_matches_flashinfer_0_5_3(path: str, namespace: str) -> None:
    theirs = FLASHINFER_0_5_3[path]
    ours = _ours(path, namespace)
    by_name = {p.name: p for p in ours}
    star = next((p for p in ours if p.kind is inspect.Parameter.VAR_POSITIONAL), None)
    after_star = False
    positions = []
    for name, default in theirs:
        if name.startswith("*"):
            assert star is not None, f"{path}: FlashInfer takes {name} (positional extra arguments); jitattn does not"
            after_star = True
            continue
        assert name in by_name, f"{path}: FlashInfer's parameter {name!r} is missing"
        param = by_name[name]
        if after_star:
            assert param.kind is inspect.Parameter.KEYWORD_ONLY, f"{path}: {name!r} must be keyword-only, as in FlashInfer"
        else:
            assert param.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, f"{path}: {name!r} must be positional"
            positions.append(ours.index(param))
        if default is not None:
            assert param.default is not inspect.Parameter.empty, f"{path}: {name!r} needs FlashInfer's default {default}"
            assert repr(param.default) == repr(eval(default)), (
                f"{path}: {name!r} defaults to {param.default!r}; FlashInfer's default is {default}")
    assert positions == sorted(positions), f"{path}: positional parameters are not in FlashInfer's order"
    known = {name for name, _ in theirs}
    last_theirs = max(positions, default=-1)
    for index, param in enumerate(ours):
        if param.name in known or param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        assert param.default is not inspect.Parameter.empty, f"{path}: jitattn's extra {param.name!r} needs a default"
        assert param.kind is inspect.Parameter.KEYWORD_ONLY or index > last_theirs, (
            f"{path}: jitattn's extra {param.name!r} sits between FlashInfer's positional parameters")


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_module_paths_match_flashinfer(namespace: str) -> None:
    jitattn = importlib.import_module(namespace)

    for path in FLASHINFER_0_5_3:
        module_name, name = path.split(".")[:2]
        assert hasattr(importlib.import_module(f"{namespace}.{module_name}"), name), f"{namespace}.{module_name}.{name}"
        assert hasattr(jitattn, name), f"{namespace}.{name}"
    for name in ("run_return_lse",):
        for cls in (jitattn.BatchDecodeWithPagedKVCacheWrapper, jitattn.BatchPrefillWithPagedKVCacheWrapper,
                    jitattn.BatchPrefillWithRaggedKVCacheWrapper, jitattn.MultiLevelCascadeAttentionWrapper):
            assert callable(getattr(cls, name)), f"{cls.__name__}.{name}"
    assert jitattn.single_prefill_with_kv_cache_return_lse.keywords == {"return_lse": True}
