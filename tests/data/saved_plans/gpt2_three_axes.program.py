# after strip_export_checks: sha256 5c75da98d04e18371ea5d82254ddea429fc51c5b9ffec9614deceb88ffc0207f
# after place_on_device: sha256 fe1342cb20e3d4555c6b580f02edc4be702c5a2b7f8556cd678eb4e162375f8a
# after apply_plan: sha256 847c75d6fb5a929e2ca617271f5927b3107e8fe1c8e3532da8b016da2bda9840
# after insert_redistributions: sha256 29d9b5e8a025d0b06e58b6d7438bdf342356d7a3fc1eb4815014025c3b9f56f0
# after lower_collectives: sha256 6c05f2c77cfd00f896bfbd964b76d9e7b1f6701dcbc48b02068f8cdb05ba5686
# after drop_layout_constraints: sha256 f6f7d4032dc438637291b519bfa59dca52d16a411fc3421417dbcc30bcdc761d
# after localize_shapes: sha256 3a2f52ca06b6a44d4a9b1a83a2eb970d77210e38a4acdab2a58577e86c7b9dbd
# after localize_lookups: sha256 29a7384ed8e979d70ba7ced7a70efdfdc55ac9108f707a3150ae9d4e67ca3757
# after localize_views: sha256 b0d69ecf000c182e0363ce4845f9d624e52f88204e21f02dc48c99423c90b251
# after verify_layouts: sha256 9d2c7e601ca4c2885f569427f73d076a7ff9b7a837a637e7f0d4af29aae5fcb3
# after check_local_program: sha256 00f566c5ad322ec660e9fc9fe15c88b0cbbea1827aac348b392db17f9fa337fa
# after mark_recompute: sha256 ab3eb822d1a014cea9bc9c5f61eb1ab70ade8ea5d50daaa7836f7dad73c69a7d
# after apply_recompute: sha256 2c24009c0429ae4acda028f435ec9bf0d701646de92fde5ff47993651a698794
# after split_stages: sha256 3f1be678d90298e14cae5d0c538b85b3ef8eeaf5501db30f941eccb1db606c74
# final program



def forward(self, p_transformer_wte_weight, p_transformer_wpe_weight, p_transformer_h_0_ln_1_weight, p_transformer_h_0_ln_1_bias, p_transformer_h_0_attn_c_attn_weight, p_transformer_h_0_attn_c_attn_bias, p_transformer_h_0_attn_c_proj_weight, p_transformer_h_0_attn_c_proj_bias, p_transformer_h_0_ln_2_weight, p_transformer_h_0_ln_2_bias, p_transformer_h_0_mlp_c_fc_weight, p_transformer_h_0_mlp_c_fc_bias, p_transformer_h_0_mlp_c_proj_weight, p_transformer_h_0_mlp_c_proj_bias, p_transformer_h_1_ln_1_weight, p_transformer_h_1_ln_1_bias, p_transformer_h_1_attn_c_attn_weight, p_transformer_h_1_attn_c_attn_bias, p_transformer_h_1_attn_c_proj_weight, p_transformer_h_1_attn_c_proj_bias, p_transformer_h_1_ln_2_weight, p_transformer_h_1_ln_2_bias, p_transformer_h_1_mlp_c_fc_weight, p_transformer_h_1_mlp_c_fc_bias, p_transformer_h_1_mlp_c_proj_weight, p_transformer_h_1_mlp_c_proj_bias, p_transformer_ln_f_weight, p_transformer_ln_f_bias, p_lm_head_weight, input_ids, labels, use_cache, return_dict):
    view = torch.ops.aten.reshape.default(input_ids, [1, 8]);  input_ids = None
    check_ids_default = torch.ops.autopar.check_ids.default(view, 128, 'sp,tp', "embedding 'embedding' of module 'transformer.wte' (dim 0 of parameter 'lm_head.weight', split over mesh axis 'dp')");  view = None
    block_index_default = torch.ops.autopar.block_index.default(check_ids_default, 'dp', [0, 64, 128])
    in_block_default = torch.ops.autopar.in_block.default(check_ids_default, 'dp', [0, 64, 128], 0, 1);  check_ids_default = None
    embedding = torch.ops.aten.embedding.default(p_lm_head_weight, block_index_default);  block_index_default = None
    where_scalar_other = torch.ops.aten.where.ScalarOther(in_block_default, embedding, 0.0);  in_block_default = embedding = None
    arange = torch.ops.aten.arange.default(8, device = device(type='cpu'), pin_memory = False)
    add = torch.ops.aten.add.Tensor(arange, 0);  arange = None
    unsqueeze = torch.ops.aten.unsqueeze.default(add, 0);  add = None
    shard_default = torch.ops.autopar.shard.default(unsqueeze, 1, 'dp')
    embedding_1 = torch.ops.aten.embedding.default(p_transformer_wpe_weight, shard_default);  p_transformer_wpe_weight = shard_default = None
    to = torch.ops.aten.to.dtype_layout(embedding_1, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'));  embedding_1 = None
    all_gather_default = torch.ops.autopar.all_gather.default(to, 2, 'tp', 'reduce_scatter');  to = None
    all_gather_default_1 = torch.ops.autopar.all_gather.default(all_gather_default, 2, 'sp', 'reduce_scatter');  all_gather_default = None
    to_partial_default = torch.ops.autopar.to_partial.default(all_gather_default_1, 'dp', 1);  all_gather_default_1 = None
    add_1 = torch.ops.aten.add.Tensor(where_scalar_other, to_partial_default);  where_scalar_other = to_partial_default = None
    expand = torch.ops.aten.expand.default(unsqueeze, [4, 8])
    slice_1 = torch.ops.aten.slice.Tensor(expand, 1, 0, 1)
    sub = torch.ops.aten.sub.Tensor(slice_1, 1);  slice_1 = None
    diff = torch.ops.aten.diff.default(expand, 1, -1, sub);  expand = sub = None
    ne = torch.ops.aten.ne.Scalar(diff, 1);  diff = None
    cumsum = torch.ops.aten.cumsum.default(ne, -1);  ne = None
    expand_1 = torch.ops.aten.expand.default(unsqueeze, [4, 8]);  unsqueeze = None
    arange_1 = torch.ops.aten.arange.default(4, device = device(type='cpu'), pin_memory = False)
    arange_2 = torch.ops.aten.arange.default(1, device = device(type='cpu'), pin_memory = False)
    arange_3 = torch.ops.aten.arange.default(8, device = device(type='cpu'), pin_memory = False)
    add_2 = torch.ops.aten.add.Tensor(arange_3, 0);  arange_3 = None
    arange_4 = torch.ops.aten.arange.default(8, device = device(type='cpu'), pin_memory = False)
    add_3 = torch.ops.aten.add.Tensor(arange_4, 0);  arange_4 = None
    unsqueeze_1 = torch.ops.aten.unsqueeze.default(arange_1, 1);  arange_1 = None
    unsqueeze_2 = torch.ops.aten.unsqueeze.default(unsqueeze_1, 2);  unsqueeze_1 = None
    unsqueeze_3 = torch.ops.aten.unsqueeze.default(unsqueeze_2, 3);  unsqueeze_2 = None
    unsqueeze_4 = torch.ops.aten.unsqueeze.default(arange_2, 0);  arange_2 = None
    unsqueeze_5 = torch.ops.aten.unsqueeze.default(unsqueeze_4, 2);  unsqueeze_4 = None
    unsqueeze_6 = torch.ops.aten.unsqueeze.default(unsqueeze_5, 3);  unsqueeze_5 = unsqueeze_6 = None
    unsqueeze_7 = torch.ops.aten.unsqueeze.default(add_2, 0);  add_2 = None
    unsqueeze_8 = torch.ops.aten.unsqueeze.default(unsqueeze_7, 1);  unsqueeze_7 = None
    unsqueeze_9 = torch.ops.aten.unsqueeze.default(unsqueeze_8, 3);  unsqueeze_8 = None
    unsqueeze_10 = torch.ops.aten.unsqueeze.default(add_3, 0);  add_3 = None
    unsqueeze_11 = torch.ops.aten.unsqueeze.default(unsqueeze_10, 1);  unsqueeze_10 = None
    unsqueeze_12 = torch.ops.aten.unsqueeze.default(unsqueeze_11, 2);  unsqueeze_11 = None
    new_ones = torch.ops.aten.new_ones.default(unsqueeze_9, [], dtype = torch.bool, pin_memory = False)
    index = torch.ops.aten.index.Tensor(expand_1, [unsqueeze_3, unsqueeze_9])
    index_1 = torch.ops.aten.index.Tensor(expand_1, [unsqueeze_3, unsqueeze_12]);  expand_1 = None
    shard_default_1 = torch.ops.autopar.shard.default(index_1, 0, 'sp');  index_1 = None
    shard_default_2 = torch.ops.autopar.shard.default(shard_default_1, 0, 'tp');  shard_default_1 = None
    shard_default_3 = torch.ops.autopar.shard.default(index, 0, 'sp');  index = None
    shard_default_4 = torch.ops.autopar.shard.default(shard_default_3, 0, 'tp');  shard_default_3 = None
    le = torch.ops.aten.le.Tensor(shard_default_2, shard_default_4);  shard_default_2 = shard_default_4 = None
    to_1 = torch.ops.aten.to.dtype_layout(le, dtype = torch.bool, layout = torch.strided, device = device(type='cpu'));  le = None
    and_1 = torch.ops.aten.__and__.Tensor(new_ones, to_1);  new_ones = to_1 = None
    index_2 = torch.ops.aten.index.Tensor(cumsum, [unsqueeze_3, unsqueeze_9]);  unsqueeze_9 = None
    index_3 = torch.ops.aten.index.Tensor(cumsum, [unsqueeze_3, unsqueeze_12]);  cumsum = unsqueeze_3 = unsqueeze_12 = None
    shard_default_5 = torch.ops.autopar.shard.default(index_2, 0, 'sp');  index_2 = None
    shard_default_6 = torch.ops.autopar.shard.default(shard_default_5, 0, 'tp');  shard_default_5 = None
    shard_default_7 = torch.ops.autopar.shard.default(index_3, 0, 'sp');  index_3 = None
    shard_default_8 = torch.ops.autopar.shard.default(shard_default_7, 0, 'tp');  shard_default_7 = None
    eq = torch.ops.aten.eq.Tensor(shard_default_6, shard_default_8);  shard_default_6 = shard_default_8 = None
    to_2 = torch.ops.aten.to.dtype_layout(eq, dtype = torch.bool, layout = torch.strided, device = device(type='cpu'));  eq = None
    and_2 = torch.ops.aten.__and__.Tensor(and_1, to_2);  and_1 = to_2 = None
    expand_2 = torch.ops.aten.expand.default(and_2, [1, 1, 8, 8]);  and_2 = None
    all_reduce_default = torch.ops.autopar.all_reduce.default(add_1, 'dp', 'identity');  add_1 = None
    dropout = torch.ops.aten.dropout.default(all_reduce_default, 0.0, True);  all_reduce_default = None
    shard_default_9 = torch.ops.autopar.shard.default(dropout, 1, 'dp');  dropout = None
    layer_norm = torch.ops.aten.layer_norm.default(shard_default_9, [64], p_transformer_h_0_ln_1_weight, p_transformer_h_0_ln_1_bias, 1e-05, False);  p_transformer_h_0_ln_1_weight = p_transformer_h_0_ln_1_bias = None
    all_gather_default_2 = torch.ops.autopar.all_gather.default(layer_norm, 1, 'dp', 'slice');  layer_norm = None
    view_1 = torch.ops.aten.reshape.default(all_gather_default_2, [8, 64]);  all_gather_default_2 = None
    grad_all_reduce_default = torch.ops.autopar.grad_all_reduce.default(view_1, 'dp');  view_1 = None
    addmm = torch.ops.aten.addmm.default(p_transformer_h_0_attn_c_attn_bias, grad_all_reduce_default, p_transformer_h_0_attn_c_attn_weight);  p_transformer_h_0_attn_c_attn_bias = grad_all_reduce_default = p_transformer_h_0_attn_c_attn_weight = None
    view_2 = torch.ops.aten.reshape.default(addmm, [1, 8, 96]);  addmm = None
    all_gather_default_3 = torch.ops.autopar.all_gather.default(view_2, 2, 'dp', 'slice');  view_2 = None
    split = torch.ops.aten.split.Tensor(all_gather_default_3, 64, 2);  all_gather_default_3 = None
    getitem = split[0]
    getitem_1 = split[1]
    getitem_2 = split[2];  split = None
    view_3 = torch.ops.aten.reshape.default(getitem_1, [1, 8, 4, 16]);  getitem_1 = None
    transpose = torch.ops.aten.transpose.int(view_3, 1, 2);  view_3 = None
    view_4 = torch.ops.aten.reshape.default(getitem_2, [1, 8, 4, 16]);  getitem_2 = None
    transpose_1 = torch.ops.aten.transpose.int(view_4, 1, 2);  view_4 = None
    view_5 = torch.ops.aten.reshape.default(getitem, [1, 8, 4, 16]);  getitem = None
    transpose_2 = torch.ops.aten.transpose.int(view_5, 1, 2);  view_5 = None
    shard_default_10 = torch.ops.autopar.shard.default(transpose_2, 1, 'dp');  transpose_2 = None
    shard_default_11 = torch.ops.autopar.shard.default(transpose, 1, 'dp');  transpose = None
    shard_default_12 = torch.ops.autopar.shard.default(transpose_1, 1, 'dp');  transpose_1 = None
    scaled_dot_product_attention = torch.ops.aten.scaled_dot_product_attention.default(shard_default_10, shard_default_11, shard_default_12, expand_2, scale = 0.25);  shard_default_10 = shard_default_11 = shard_default_12 = None
    reshape = torch.ops.aten.reshape.default(scaled_dot_product_attention, [1, 2, 8, 16]);  scaled_dot_product_attention = None
    transpose_3 = torch.ops.aten.transpose.int(reshape, 1, 2);  reshape = None
    reshape_1 = torch.ops.aten.reshape.default(transpose_3, [1, 8, 32]);  transpose_3 = None
    view_6 = torch.ops.aten.reshape.default(reshape_1, [8, 32]);  reshape_1 = None
    all_gather_default_4 = torch.ops.autopar.all_gather.default(view_6, 1, 'dp', 'reduce_scatter');  view_6 = None
    addmm_1 = torch.ops.aten.addmm.default(p_transformer_h_0_attn_c_proj_bias, all_gather_default_4, p_transformer_h_0_attn_c_proj_weight);  p_transformer_h_0_attn_c_proj_bias = all_gather_default_4 = p_transformer_h_0_attn_c_proj_weight = None
    view_7 = torch.ops.aten.reshape.default(addmm_1, [1, 8, 32]);  addmm_1 = None
    dropout_1 = torch.ops.aten.dropout.default(view_7, 0.0, True);  view_7 = None
    all_to_all_default = torch.ops.autopar.all_to_all.default(shard_default_9, 1, 2, 'dp');  shard_default_9 = None
    add_4 = torch.ops.aten.add.Tensor(dropout_1, all_to_all_default);  dropout_1 = all_to_all_default = None
    all_gather_default_5 = torch.ops.autopar.all_gather.default(add_4, 2, 'dp', 'slice')
    layer_norm_1 = torch.ops.aten.layer_norm.default(all_gather_default_5, [64], p_transformer_h_0_ln_2_weight, p_transformer_h_0_ln_2_bias, 1e-05, False);  all_gather_default_5 = p_transformer_h_0_ln_2_weight = p_transformer_h_0_ln_2_bias = None
    view_8 = torch.ops.aten.reshape.default(layer_norm_1, [8, 64]);  layer_norm_1 = None
    all_gather_default_6 = torch.ops.autopar.all_gather.default(view_8, 0, 'tp', 'reduce_scatter');  view_8 = None
    all_gather_default_7 = torch.ops.autopar.all_gather.default(all_gather_default_6, 0, 'sp', 'reduce_scatter');  all_gather_default_6 = None
    shard_default_13 = torch.ops.autopar.shard.default(all_gather_default_7, 0, 'dp');  all_gather_default_7 = None
    addmm_2 = torch.ops.aten.addmm.default(p_transformer_h_0_mlp_c_fc_bias, shard_default_13, p_transformer_h_0_mlp_c_fc_weight);  p_transformer_h_0_mlp_c_fc_bias = shard_default_13 = p_transformer_h_0_mlp_c_fc_weight = None
    view_9 = torch.ops.aten.reshape.default(addmm_2, [2, 8, 64]);  addmm_2 = None
    mul = torch.ops.aten.mul.Tensor(view_9, 0.5)
    pow_1 = torch.ops.aten.pow.Tensor_Scalar(view_9, 3.0)
    mul_1 = torch.ops.aten.mul.Tensor(pow_1, 0.044715);  pow_1 = None
    add_5 = torch.ops.aten.add.Tensor(view_9, mul_1);  view_9 = mul_1 = None
    mul_2 = torch.ops.aten.mul.Tensor(add_5, 0.7978845608028654);  add_5 = None
    tanh = torch.ops.aten.tanh.default(mul_2);  mul_2 = None
    add_6 = torch.ops.aten.add.Tensor(tanh, 1.0);  tanh = None
    mul_3 = torch.ops.aten.mul.Tensor(mul, add_6);  mul = add_6 = None
    view_10 = torch.ops.aten.reshape.default(mul_3, [16, 64]);  mul_3 = None
    to_partial_default_1 = torch.ops.autopar.to_partial.default(p_transformer_h_0_mlp_c_proj_bias, 'sp', -1);  p_transformer_h_0_mlp_c_proj_bias = None
    to_partial_default_2 = torch.ops.autopar.to_partial.default(to_partial_default_1, 'tp', -1);  to_partial_default_1 = None
    all_gather_default_8 = torch.ops.autopar.all_gather.default(view_10, 0, 'dp', 'reduce_scatter');  view_10 = None
    addmm_3 = torch.ops.aten.addmm.default(to_partial_default_2, all_gather_default_8, p_transformer_h_0_mlp_c_proj_weight);  to_partial_default_2 = all_gather_default_8 = p_transformer_h_0_mlp_c_proj_weight = None
    view_11 = torch.ops.aten.reshape.default(addmm_3, [4, 8, 32]);  addmm_3 = None
    all_reduce_default_1 = torch.ops.autopar.all_reduce.default(view_11, 'sp', 'identity');  view_11 = None
    all_reduce_default_2 = torch.ops.autopar.all_reduce.default(all_reduce_default_1, 'tp', 'identity');  all_reduce_default_1 = None
    dropout_2 = torch.ops.aten.dropout.default(all_reduce_default_2, 0.0, True);  all_reduce_default_2 = None
    shard_default_14 = torch.ops.autopar.shard.default(dropout_2, 0, 'sp');  dropout_2 = None
    shard_default_15 = torch.ops.autopar.shard.default(shard_default_14, 0, 'tp');  shard_default_14 = None
    add_7 = torch.ops.aten.add.Tensor(add_4, shard_default_15);  add_4 = shard_default_15 = None
    all_to_all_default_1 = torch.ops.autopar.all_to_all.default(add_7, 2, 1, 'dp');  add_7 = None
    layer_norm_2 = torch.ops.aten.layer_norm.default(all_to_all_default_1, [64], p_transformer_h_1_ln_1_weight, p_transformer_h_1_ln_1_bias, 1e-05, False);  p_transformer_h_1_ln_1_weight = p_transformer_h_1_ln_1_bias = None
    all_gather_default_9 = torch.ops.autopar.all_gather.default(layer_norm_2, 1, 'dp', 'slice');  layer_norm_2 = None
    view_12 = torch.ops.aten.reshape.default(all_gather_default_9, [8, 64]);  all_gather_default_9 = None
    grad_all_reduce_default_1 = torch.ops.autopar.grad_all_reduce.default(view_12, 'dp');  view_12 = None
    addmm_4 = torch.ops.aten.addmm.default(p_transformer_h_1_attn_c_attn_bias, grad_all_reduce_default_1, p_transformer_h_1_attn_c_attn_weight);  p_transformer_h_1_attn_c_attn_bias = grad_all_reduce_default_1 = p_transformer_h_1_attn_c_attn_weight = None
    view_13 = torch.ops.aten.reshape.default(addmm_4, [1, 8, 96]);  addmm_4 = None
    all_gather_default_10 = torch.ops.autopar.all_gather.default(view_13, 2, 'dp', 'slice');  view_13 = None
    split_1 = torch.ops.aten.split.Tensor(all_gather_default_10, 64, 2);  all_gather_default_10 = None
    getitem_3 = split_1[0]
    getitem_4 = split_1[1]
    getitem_5 = split_1[2];  split_1 = None
    view_14 = torch.ops.aten.reshape.default(getitem_4, [1, 8, 4, 16]);  getitem_4 = None
    transpose_4 = torch.ops.aten.transpose.int(view_14, 1, 2);  view_14 = None
    view_15 = torch.ops.aten.reshape.default(getitem_5, [1, 8, 4, 16]);  getitem_5 = None
    transpose_5 = torch.ops.aten.transpose.int(view_15, 1, 2);  view_15 = None
    view_16 = torch.ops.aten.reshape.default(getitem_3, [1, 8, 4, 16]);  getitem_3 = None
    transpose_6 = torch.ops.aten.transpose.int(view_16, 1, 2);  view_16 = None
    shard_default_16 = torch.ops.autopar.shard.default(transpose_6, 1, 'dp');  transpose_6 = None
    shard_default_17 = torch.ops.autopar.shard.default(transpose_4, 1, 'dp');  transpose_4 = None
    shard_default_18 = torch.ops.autopar.shard.default(transpose_5, 1, 'dp');  transpose_5 = None
    scaled_dot_product_attention_1 = torch.ops.aten.scaled_dot_product_attention.default(shard_default_16, shard_default_17, shard_default_18, expand_2, scale = 0.25);  shard_default_16 = shard_default_17 = shard_default_18 = expand_2 = None
    reshape_2 = torch.ops.aten.reshape.default(scaled_dot_product_attention_1, [1, 2, 8, 16]);  scaled_dot_product_attention_1 = None
    transpose_7 = torch.ops.aten.transpose.int(reshape_2, 1, 2);  reshape_2 = None
    reshape_3 = torch.ops.aten.reshape.default(transpose_7, [1, 8, 32]);  transpose_7 = None
    view_17 = torch.ops.aten.reshape.default(reshape_3, [8, 32]);  reshape_3 = None
    all_gather_default_11 = torch.ops.autopar.all_gather.default(view_17, 1, 'dp', 'reduce_scatter');  view_17 = None
    addmm_5 = torch.ops.aten.addmm.default(p_transformer_h_1_attn_c_proj_bias, all_gather_default_11, p_transformer_h_1_attn_c_proj_weight);  p_transformer_h_1_attn_c_proj_bias = all_gather_default_11 = p_transformer_h_1_attn_c_proj_weight = None
    view_18 = torch.ops.aten.reshape.default(addmm_5, [1, 8, 32]);  addmm_5 = None
    dropout_3 = torch.ops.aten.dropout.default(view_18, 0.0, True);  view_18 = None
    all_to_all_default_2 = torch.ops.autopar.all_to_all.default(all_to_all_default_1, 1, 2, 'dp');  all_to_all_default_1 = None
    add_8 = torch.ops.aten.add.Tensor(dropout_3, all_to_all_default_2);  dropout_3 = all_to_all_default_2 = None
    all_gather_default_12 = torch.ops.autopar.all_gather.default(add_8, 2, 'dp', 'slice')
    layer_norm_3 = torch.ops.aten.layer_norm.default(all_gather_default_12, [64], p_transformer_h_1_ln_2_weight, p_transformer_h_1_ln_2_bias, 1e-05, False);  all_gather_default_12 = p_transformer_h_1_ln_2_weight = p_transformer_h_1_ln_2_bias = None
    view_19 = torch.ops.aten.reshape.default(layer_norm_3, [8, 64]);  layer_norm_3 = None
    all_gather_default_13 = torch.ops.autopar.all_gather.default(view_19, 0, 'tp', 'reduce_scatter');  view_19 = None
    all_gather_default_14 = torch.ops.autopar.all_gather.default(all_gather_default_13, 0, 'sp', 'reduce_scatter');  all_gather_default_13 = None
    shard_default_19 = torch.ops.autopar.shard.default(all_gather_default_14, 0, 'dp');  all_gather_default_14 = None
    addmm_6 = torch.ops.aten.addmm.default(p_transformer_h_1_mlp_c_fc_bias, shard_default_19, p_transformer_h_1_mlp_c_fc_weight);  p_transformer_h_1_mlp_c_fc_bias = shard_default_19 = p_transformer_h_1_mlp_c_fc_weight = None
    view_20 = torch.ops.aten.reshape.default(addmm_6, [2, 8, 64]);  addmm_6 = None
    mul_4 = torch.ops.aten.mul.Tensor(view_20, 0.5)
    pow_2 = torch.ops.aten.pow.Tensor_Scalar(view_20, 3.0)
    mul_5 = torch.ops.aten.mul.Tensor(pow_2, 0.044715);  pow_2 = None
    add_9 = torch.ops.aten.add.Tensor(view_20, mul_5);  view_20 = mul_5 = None
    mul_6 = torch.ops.aten.mul.Tensor(add_9, 0.7978845608028654);  add_9 = None
    tanh_1 = torch.ops.aten.tanh.default(mul_6);  mul_6 = None
    add_10 = torch.ops.aten.add.Tensor(tanh_1, 1.0);  tanh_1 = None
    mul_7 = torch.ops.aten.mul.Tensor(mul_4, add_10);  mul_4 = add_10 = None
    view_21 = torch.ops.aten.reshape.default(mul_7, [16, 64]);  mul_7 = None
    to_partial_default_3 = torch.ops.autopar.to_partial.default(p_transformer_h_1_mlp_c_proj_bias, 'sp', -1);  p_transformer_h_1_mlp_c_proj_bias = None
    to_partial_default_4 = torch.ops.autopar.to_partial.default(to_partial_default_3, 'tp', -1);  to_partial_default_3 = None
    all_gather_default_15 = torch.ops.autopar.all_gather.default(view_21, 0, 'dp', 'reduce_scatter');  view_21 = None
    addmm_7 = torch.ops.aten.addmm.default(to_partial_default_4, all_gather_default_15, p_transformer_h_1_mlp_c_proj_weight);  to_partial_default_4 = all_gather_default_15 = p_transformer_h_1_mlp_c_proj_weight = None
    view_22 = torch.ops.aten.reshape.default(addmm_7, [4, 8, 32]);  addmm_7 = None
    all_reduce_default_3 = torch.ops.autopar.all_reduce.default(view_22, 'sp', 'identity');  view_22 = None
    all_reduce_default_4 = torch.ops.autopar.all_reduce.default(all_reduce_default_3, 'tp', 'identity');  all_reduce_default_3 = None
    dropout_4 = torch.ops.aten.dropout.default(all_reduce_default_4, 0.0, True);  all_reduce_default_4 = None
    shard_default_20 = torch.ops.autopar.shard.default(dropout_4, 0, 'sp');  dropout_4 = None
    shard_default_21 = torch.ops.autopar.shard.default(shard_default_20, 0, 'tp');  shard_default_20 = None
    add_11 = torch.ops.aten.add.Tensor(add_8, shard_default_21);  add_8 = shard_default_21 = None
    all_to_all_default_3 = torch.ops.autopar.all_to_all.default(add_11, 2, 1, 'dp');  add_11 = None
    layer_norm_4 = torch.ops.aten.layer_norm.default(all_to_all_default_3, [64], p_transformer_ln_f_weight, p_transformer_ln_f_bias, 1e-05, False);  all_to_all_default_3 = p_transformer_ln_f_weight = p_transformer_ln_f_bias = None
    view_23 = torch.ops.aten.reshape.default(layer_norm_4, [1, 4, 64]);  layer_norm_4 = None
    alias = torch.ops.aten.alias.default(view_23);  view_23 = None
    all_gather_default_16 = torch.ops.autopar.all_gather.default(alias, 1, 'dp', 'reduce_scatter');  alias = None
    linear = torch.ops.aten.linear.default(all_gather_default_16, p_lm_head_weight);  all_gather_default_16 = p_lm_head_weight = None
    to_3 = torch.ops.aten.to.dtype(linear, torch.float32);  linear = None
    pad = torch.ops.aten.pad.default(labels, [0, 1], 'constant', -100.0);  labels = None
    slice_2 = torch.ops.aten.slice.Tensor(pad, 1, 1, 9223372036854775807);  pad = None
    contiguous = torch.ops.aten.contiguous.default(slice_2);  slice_2 = None
    view_24 = torch.ops.aten.reshape.default(to_3, [8, 64])
    view_25 = torch.ops.aten.reshape.default(contiguous, [32]);  contiguous = None
    to_4 = torch.ops.aten.to.dtype_layout(view_25, dtype = torch.int64, layout = torch.strided, device = device(type='cpu'));  view_25 = None
    detach = torch.ops.aten.detach.default(view_24)
    amax = torch.ops.aten.amax.default(detach, [1], True);  detach = None
    all_reduce_max_default = torch.ops.autopar.all_reduce_max.default(amax, 'dp')
    sub_1 = torch.ops.aten.sub.Tensor(view_24, all_reduce_max_default);  all_reduce_max_default = None
    exp = torch.ops.aten.exp.default(sub_1);  sub_1 = None
    sum_1 = torch.ops.aten.sum.dim_IntList(exp, [1], True);  exp = None
    all_reduce_default_5 = torch.ops.autopar.all_reduce.default(sum_1, 'dp', 'identity');  sum_1 = None
    log = torch.ops.aten.log.default(all_reduce_default_5);  all_reduce_default_5 = None
    all_reduce_max_default_1 = torch.ops.autopar.all_reduce_max.default(amax, 'dp');  amax = None
    add_12 = torch.ops.aten.add.Tensor(log, all_reduce_max_default_1);  log = all_reduce_max_default_1 = None
    ne_1 = torch.ops.aten.ne.Scalar(to_4, -100)
    where = torch.ops.aten.where.ScalarOther(ne_1, to_4, 0);  to_4 = None
    unsqueeze_13 = torch.ops.aten.unsqueeze.default(where, 1);  where = None
    shard_default_22 = torch.ops.autopar.shard.default(unsqueeze_13, 0, 'sp');  unsqueeze_13 = None
    shard_default_23 = torch.ops.autopar.shard.default(shard_default_22, 0, 'tp');  shard_default_22 = None
    check_ids_default_1 = torch.ops.autopar.check_ids.default(shard_default_23, 128, 'sp,tp', "gather 'gather' of module '<root>' (dim 1, split over mesh axis 'dp')");  shard_default_23 = None
    block_index_default_1 = torch.ops.autopar.block_index.default(check_ids_default_1, 'dp', [0, 64, 128])
    in_block_default_1 = torch.ops.autopar.in_block.default(check_ids_default_1, 'dp', [0, 64, 128], 0, 0);  check_ids_default_1 = None
    gather = torch.ops.aten.gather.default(view_24, 1, block_index_default_1);  view_24 = block_index_default_1 = None
    where_scalar_other_1 = torch.ops.aten.where.ScalarOther(in_block_default_1, gather, 0.0);  in_block_default_1 = gather = None
    squeeze = torch.ops.aten.squeeze.dim(where_scalar_other_1, 1);  where_scalar_other_1 = None
    to_5 = torch.ops.aten.to.dtype(ne_1, torch.float32);  ne_1 = None
    squeeze_1 = torch.ops.aten.squeeze.dim(add_12, 1);  add_12 = None
    all_reduce_default_6 = torch.ops.autopar.all_reduce.default(squeeze, 'dp', 'identity');  squeeze = None
    sub_2 = torch.ops.aten.sub.Tensor(squeeze_1, all_reduce_default_6);  squeeze_1 = all_reduce_default_6 = None
    shard_default_24 = torch.ops.autopar.shard.default(to_5, 0, 'sp')
    shard_default_25 = torch.ops.autopar.shard.default(shard_default_24, 0, 'tp');  shard_default_24 = None
    mul_8 = torch.ops.aten.mul.Tensor(sub_2, shard_default_25);  sub_2 = shard_default_25 = None
    sum_2 = torch.ops.aten.sum.default(to_5);  to_5 = None
    sum_3 = torch.ops.aten.sum.default(mul_8);  mul_8 = None
    div = torch.ops.aten.div.Tensor(sum_3, sum_2);  sum_3 = sum_2 = None
    all_reduce_default_7 = torch.ops.autopar.all_reduce.default(div, 'sp', 'identity');  div = None
    all_reduce_default_8 = torch.ops.autopar.all_reduce.default(all_reduce_default_7, 'tp', 'identity');  all_reduce_default_7 = None
    return (all_reduce_default_8, to_3)
    