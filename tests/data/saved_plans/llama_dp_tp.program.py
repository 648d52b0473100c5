# after strip_export_checks: sha256 ee059ab217edaa29ddda573d860e48934039cbb963f43def1ea58100f8529fdd
# after place_on_device: sha256 72128fce298822fcf4ce7b6a62563d002a8995af4d8429c2e936503c476c5a06
# after apply_plan: sha256 86aedbcb477afa0b093649c40375c4f5b86db38dec6e2e930e9f83511a4b7c06
# after insert_redistributions: sha256 70132a8a2d28742e53d083bd8ab350b501b996739ecc4f25fd1f26fe7b03c1c8
# after lower_collectives: sha256 c226d92a965fbf18a3df561cba10b91be9e1af9bcd0ed40fba210521e23100a8
# after drop_layout_constraints: sha256 ab7d5ed23031622fb272a28d1c4aae0b503857619ca8e2e652d5400a52bcfdfe
# after localize_shapes: sha256 36f0415c8a858cbf7834ff087b39820dbd7fd46aaef9241b973cd723c63b3f8b
# after localize_lookups: sha256 d1d96474d0498d4edfd783ade2df721ec10aacbfd446347a77b8e3da8bc4a62b
# after localize_views: sha256 04f2c30936688c17b974025f2a3b9ba172e293b0c3dabb41a298823952dba8a5
# after verify_layouts: sha256 0ed5d24c325a06bc9ba86819e13a2dcedd4af4fbe983103a59ccf67ed087f8cd
# after check_local_program: sha256 02351c55685f7d912c06df5517aae5bc5fc0e826a40459e7a5d0d841c00d9ec1
# after mark_recompute: sha256 4e340856906b157edbe54b04095fde4bb04b6b3fb3ffd999ae0c184b45b25f82
# after apply_recompute: sha256 a30fd7949cb772d2a952e5f38b602396561eb95cfb05d145a435b09fe60f6322
# after split_stages: sha256 74a411a9c37686dd3892f4ec278ea95a565378ce08319073d31976bccad8ab6c
# final program



def forward(self, p_model_embed_tokens_weight, p_model_layers_0_self_attn_q_proj_weight, p_model_layers_0_self_attn_k_proj_weight, p_model_layers_0_self_attn_v_proj_weight, p_model_layers_0_self_attn_o_proj_weight, p_model_layers_0_mlp_gate_proj_weight, p_model_layers_0_mlp_up_proj_weight, p_model_layers_0_mlp_down_proj_weight, p_model_layers_0_input_layernorm_weight, p_model_layers_0_post_attention_layernorm_weight, p_model_layers_1_self_attn_q_proj_weight, p_model_layers_1_self_attn_k_proj_weight, p_model_layers_1_self_attn_v_proj_weight, p_model_layers_1_self_attn_o_proj_weight, p_model_layers_1_mlp_gate_proj_weight, p_model_layers_1_mlp_up_proj_weight, p_model_layers_1_mlp_down_proj_weight, p_model_layers_1_input_layernorm_weight, p_model_layers_1_post_attention_layernorm_weight, p_model_norm_weight, p_lm_head_weight, b_model_rotary_emb_inv_freq, b_model_rotary_emb_original_inv_freq, input_ids, labels, use_cache, return_dict):
    check_ids_default = torch.ops.autopar.check_ids.default(input_ids, 128, 'tp', "embedding 'embedding' of module 'model.embed_tokens' (dim 0 of parameter 'model.embed_tokens.weight', split over mesh axis 'dp')");  input_ids = None
    block_index_default = torch.ops.autopar.block_index.default(check_ids_default, 'dp', [0, 64, 128])
    in_block_default = torch.ops.autopar.in_block.default(check_ids_default, 'dp', [0, 64, 128], 0, 1);  check_ids_default = None
    embedding = torch.ops.aten.embedding.default(p_model_embed_tokens_weight, block_index_default);  p_model_embed_tokens_weight = block_index_default = None
    where_scalar_other = torch.ops.aten.where.ScalarOther(in_block_default, embedding, 0.0);  in_block_default = embedding = None
    arange = torch.ops.aten.arange.default(8, device = device(type='cpu'), pin_memory = False)
    add = torch.ops.aten.add.Tensor(arange, 0);  arange = None
    unsqueeze = torch.ops.aten.unsqueeze.default(add, 0);  add = None
    expand = torch.ops.aten.expand.default(unsqueeze, [4, 8])
    slice_1 = torch.ops.aten.slice.Tensor(expand, 1, 0, 1)
    sub = torch.ops.aten.sub.Tensor(slice_1, 1);  slice_1 = None
    diff = torch.ops.aten.diff.default(expand, 1, -1, sub);  expand = sub = None
    ne = torch.ops.aten.ne.Scalar(diff, 1);  diff = None
    cumsum = torch.ops.aten.cumsum.default(ne, -1);  ne = None
    expand_1 = torch.ops.aten.expand.default(unsqueeze, [4, 8])
    arange_1 = torch.ops.aten.arange.default(4, device = device(type='cpu'), pin_memory = False)
    arange_2 = torch.ops.aten.arange.default(1, device = device(type='cpu'), pin_memory = False)
    arange_3 = torch.ops.aten.arange.default(8, device = device(type='cpu'), pin_memory = False)
    add_1 = torch.ops.aten.add.Tensor(arange_3, 0);  arange_3 = None
    arange_4 = torch.ops.aten.arange.default(8, device = device(type='cpu'), pin_memory = False)
    add_2 = torch.ops.aten.add.Tensor(arange_4, 0);  arange_4 = None
    unsqueeze_1 = torch.ops.aten.unsqueeze.default(arange_1, 1);  arange_1 = None
    unsqueeze_2 = torch.ops.aten.unsqueeze.default(unsqueeze_1, 2);  unsqueeze_1 = None
    unsqueeze_3 = torch.ops.aten.unsqueeze.default(unsqueeze_2, 3);  unsqueeze_2 = None
    unsqueeze_4 = torch.ops.aten.unsqueeze.default(arange_2, 0);  arange_2 = None
    unsqueeze_5 = torch.ops.aten.unsqueeze.default(unsqueeze_4, 2);  unsqueeze_4 = None
    unsqueeze_6 = torch.ops.aten.unsqueeze.default(unsqueeze_5, 3);  unsqueeze_5 = unsqueeze_6 = None
    unsqueeze_7 = torch.ops.aten.unsqueeze.default(add_1, 0);  add_1 = None
    unsqueeze_8 = torch.ops.aten.unsqueeze.default(unsqueeze_7, 1);  unsqueeze_7 = None
    unsqueeze_9 = torch.ops.aten.unsqueeze.default(unsqueeze_8, 3);  unsqueeze_8 = None
    unsqueeze_10 = torch.ops.aten.unsqueeze.default(add_2, 0);  add_2 = None
    unsqueeze_11 = torch.ops.aten.unsqueeze.default(unsqueeze_10, 1);  unsqueeze_10 = None
    unsqueeze_12 = torch.ops.aten.unsqueeze.default(unsqueeze_11, 2);  unsqueeze_11 = None
    new_ones = torch.ops.aten.new_ones.default(unsqueeze_9, [], dtype = torch.bool, pin_memory = False)
    index = torch.ops.aten.index.Tensor(expand_1, [unsqueeze_3, unsqueeze_9])
    index_1 = torch.ops.aten.index.Tensor(expand_1, [unsqueeze_3, unsqueeze_12]);  expand_1 = None
    shard_default = torch.ops.autopar.shard.default(index_1, 0, 'dp');  index_1 = None
    shard_default_1 = torch.ops.autopar.shard.default(index, 0, 'dp');  index = None
    shard_default_2 = torch.ops.autopar.shard.default(shard_default_1, 2, 'tp');  shard_default_1 = None
    le = torch.ops.aten.le.Tensor(shard_default, shard_default_2);  shard_default = shard_default_2 = None
    to = torch.ops.aten.to.dtype_layout(le, dtype = torch.bool, layout = torch.strided, device = device(type='cpu'));  le = None
    and_1 = torch.ops.aten.__and__.Tensor(new_ones, to);  new_ones = to = None
    index_2 = torch.ops.aten.index.Tensor(cumsum, [unsqueeze_3, unsqueeze_9]);  unsqueeze_9 = None
    index_3 = torch.ops.aten.index.Tensor(cumsum, [unsqueeze_3, unsqueeze_12]);  cumsum = unsqueeze_3 = unsqueeze_12 = None
    shard_default_3 = torch.ops.autopar.shard.default(index_2, 0, 'dp');  index_2 = None
    shard_default_4 = torch.ops.autopar.shard.default(shard_default_3, 2, 'tp');  shard_default_3 = None
    shard_default_5 = torch.ops.autopar.shard.default(index_3, 0, 'dp');  index_3 = None
    eq = torch.ops.aten.eq.Tensor(shard_default_4, shard_default_5);  shard_default_4 = shard_default_5 = None
    to_1 = torch.ops.aten.to.dtype_layout(eq, dtype = torch.bool, layout = torch.strided, device = device(type='cpu'));  eq = None
    and_2 = torch.ops.aten.__and__.Tensor(and_1, to_1);  and_1 = to_1 = None
    expand_2 = torch.ops.aten.expand.default(and_2, [2, 1, 4, 8]);  and_2 = None
    unsqueeze_13 = torch.ops.aten.unsqueeze.default(unsqueeze, 2);  unsqueeze = None
    to_2 = torch.ops.aten.to.dtype(unsqueeze_13, torch.float32);  unsqueeze_13 = None
    to_3 = torch.ops.aten.to.device(b_model_rotary_emb_inv_freq, device(type='cpu'), torch.float32);  b_model_rotary_emb_inv_freq = None
    shard_default_6 = torch.ops.autopar.shard.default(to_2, 1, 'tp');  to_2 = None
    mul = torch.ops.aten.mul.Tensor(shard_default_6, to_3);  shard_default_6 = to_3 = None
    cat = torch.ops.aten.cat.default([mul, mul], -1);  mul = None
    cos = torch.ops.aten.cos.default(cat)
    mul_1 = torch.ops.aten.mul.Tensor(cos, 1.0);  cos = None
    sin = torch.ops.aten.sin.default(cat);  cat = None
    mul_2 = torch.ops.aten.mul.Tensor(sin, 1.0);  sin = None
    to_4 = torch.ops.aten.to.dtype(mul_1, torch.float32);  mul_1 = None
    to_5 = torch.ops.aten.to.dtype(mul_2, torch.float32);  mul_2 = None
    reduce_scatter_default = torch.ops.autopar.reduce_scatter.default(where_scalar_other, 0, 'dp');  where_scalar_other = None
    to_6 = torch.ops.aten.to.dtype(reduce_scatter_default, torch.float32);  reduce_scatter_default = None
    pow_1 = torch.ops.aten.pow.Tensor_Scalar(to_6, 2)
    mean = torch.ops.aten.mean.dim(pow_1, [-1], True);  pow_1 = None
    add_3 = torch.ops.aten.add.Tensor(mean, 1e-06);  mean = None
    rsqrt = torch.ops.aten.rsqrt.default(add_3);  add_3 = None
    mul_3 = torch.ops.aten.mul.Tensor(to_6, rsqrt);  rsqrt = None
    to_7 = torch.ops.aten.to.dtype(mul_3, torch.float32);  mul_3 = None
    mul_4 = torch.ops.aten.mul.Tensor(p_model_layers_0_input_layernorm_weight, to_7);  p_model_layers_0_input_layernorm_weight = to_7 = None
    linear = torch.ops.aten.linear.default(mul_4, p_model_layers_0_self_attn_q_proj_weight);  p_model_layers_0_self_attn_q_proj_weight = None
    view = torch.ops.aten.reshape.default(linear, [2, 4, 4, 16]);  linear = None
    transpose = torch.ops.aten.transpose.int(view, 1, 2);  view = None
    linear_1 = torch.ops.aten.linear.default(mul_4, p_model_layers_0_self_attn_k_proj_weight);  p_model_layers_0_self_attn_k_proj_weight = None
    view_1 = torch.ops.aten.reshape.default(linear_1, [2, 4, 2, 16]);  linear_1 = None
    transpose_1 = torch.ops.aten.transpose.int(view_1, 1, 2);  view_1 = None
    linear_2 = torch.ops.aten.linear.default(mul_4, p_model_layers_0_self_attn_v_proj_weight);  mul_4 = p_model_layers_0_self_attn_v_proj_weight = None
    view_2 = torch.ops.aten.reshape.default(linear_2, [2, 4, 2, 16]);  linear_2 = None
    transpose_2 = torch.ops.aten.transpose.int(view_2, 1, 2);  view_2 = None
    unsqueeze_14 = torch.ops.aten.unsqueeze.default(to_4, 1)
    unsqueeze_15 = torch.ops.aten.unsqueeze.default(to_5, 1)
    mul_5 = torch.ops.aten.mul.Tensor(transpose, unsqueeze_14)
    slice_2 = torch.ops.aten.slice.Tensor(transpose, 3, 0, 8)
    slice_3 = torch.ops.aten.slice.Tensor(transpose, 3, 8, 9223372036854775807);  transpose = None
    neg = torch.ops.aten.neg.default(slice_3);  slice_3 = None
    cat_1 = torch.ops.aten.cat.default([neg, slice_2], -1);  neg = slice_2 = None
    mul_6 = torch.ops.aten.mul.Tensor(cat_1, unsqueeze_15);  cat_1 = None
    add_4 = torch.ops.aten.add.Tensor(mul_5, mul_6);  mul_5 = mul_6 = None
    mul_7 = torch.ops.aten.mul.Tensor(transpose_1, unsqueeze_14);  unsqueeze_14 = None
    slice_4 = torch.ops.aten.slice.Tensor(transpose_1, 3, 0, 8)
    slice_5 = torch.ops.aten.slice.Tensor(transpose_1, 3, 8, 9223372036854775807);  transpose_1 = None
    neg_1 = torch.ops.aten.neg.default(slice_5);  slice_5 = None
    cat_2 = torch.ops.aten.cat.default([neg_1, slice_4], -1);  neg_1 = slice_4 = None
    mul_8 = torch.ops.aten.mul.Tensor(cat_2, unsqueeze_15);  cat_2 = unsqueeze_15 = None
    add_5 = torch.ops.aten.add.Tensor(mul_7, mul_8);  mul_7 = mul_8 = None
    unsqueeze_16 = torch.ops.aten.unsqueeze.default(add_5, 2);  add_5 = None
    expand_3 = torch.ops.aten.expand.default(unsqueeze_16, [2, 2, 2, 4, 16]);  unsqueeze_16 = None
    reshape = torch.ops.aten.reshape.default(expand_3, [2, 4, 4, 16]);  expand_3 = None
    unsqueeze_17 = torch.ops.aten.unsqueeze.default(transpose_2, 2);  transpose_2 = None
    expand_4 = torch.ops.aten.expand.default(unsqueeze_17, [2, 2, 2, 4, 16]);  unsqueeze_17 = None
    reshape_1 = torch.ops.aten.reshape.default(expand_4, [2, 4, 4, 16]);  expand_4 = None
    all_gather_default = torch.ops.autopar.all_gather.default(reshape, 2, 'tp', 'reduce_scatter');  reshape = None
    all_gather_default_1 = torch.ops.autopar.all_gather.default(reshape_1, 2, 'tp', 'reduce_scatter');  reshape_1 = None
    scaled_dot_product_attention = torch.ops.aten.scaled_dot_product_attention.default(add_4, all_gather_default, all_gather_default_1, expand_2, scale = 0.25);  add_4 = all_gather_default = all_gather_default_1 = None
    reshape_2 = torch.ops.aten.reshape.default(scaled_dot_product_attention, [2, 4, 4, 16]);  scaled_dot_product_attention = None
    transpose_3 = torch.ops.aten.transpose.int(reshape_2, 1, 2);  reshape_2 = None
    reshape_3 = torch.ops.aten.reshape.default(transpose_3, [2, 4, 64]);  transpose_3 = None
    linear_3 = torch.ops.aten.linear.default(reshape_3, p_model_layers_0_self_attn_o_proj_weight);  reshape_3 = p_model_layers_0_self_attn_o_proj_weight = None
    add_6 = torch.ops.aten.add.Tensor(to_6, linear_3);  to_6 = linear_3 = None
    to_8 = torch.ops.aten.to.dtype(add_6, torch.float32);  add_6 = None
    pow_2 = torch.ops.aten.pow.Tensor_Scalar(to_8, 2)
    mean_1 = torch.ops.aten.mean.dim(pow_2, [-1], True);  pow_2 = None
    add_7 = torch.ops.aten.add.Tensor(mean_1, 1e-06);  mean_1 = None
    rsqrt_1 = torch.ops.aten.rsqrt.default(add_7);  add_7 = None
    mul_9 = torch.ops.aten.mul.Tensor(to_8, rsqrt_1);  rsqrt_1 = None
    to_9 = torch.ops.aten.to.dtype(mul_9, torch.float32);  mul_9 = None
    mul_10 = torch.ops.aten.mul.Tensor(p_model_layers_0_post_attention_layernorm_weight, to_9);  p_model_layers_0_post_attention_layernorm_weight = to_9 = None
    all_gather_default_2 = torch.ops.autopar.all_gather.default(mul_10, 0, 'dp', 'reduce_scatter')
    linear_4 = torch.ops.aten.linear.default(all_gather_default_2, p_model_layers_0_mlp_gate_proj_weight);  all_gather_default_2 = p_model_layers_0_mlp_gate_proj_weight = None
    silu = torch.ops.aten.silu.default(linear_4);  linear_4 = None
    all_gather_default_3 = torch.ops.autopar.all_gather.default(mul_10, 0, 'dp', 'reduce_scatter');  mul_10 = None
    linear_5 = torch.ops.aten.linear.default(all_gather_default_3, p_model_layers_0_mlp_up_proj_weight);  all_gather_default_3 = p_model_layers_0_mlp_up_proj_weight = None
    mul_11 = torch.ops.aten.mul.Tensor(silu, linear_5);  silu = linear_5 = None
    linear_6 = torch.ops.aten.linear.default(mul_11, p_model_layers_0_mlp_down_proj_weight);  mul_11 = p_model_layers_0_mlp_down_proj_weight = None
    reduce_scatter_default_1 = torch.ops.autopar.reduce_scatter.default(linear_6, 0, 'dp');  linear_6 = None
    add_8 = torch.ops.aten.add.Tensor(to_8, reduce_scatter_default_1);  to_8 = reduce_scatter_default_1 = None
    to_10 = torch.ops.aten.to.dtype(add_8, torch.float32);  add_8 = None
    pow_3 = torch.ops.aten.pow.Tensor_Scalar(to_10, 2)
    mean_2 = torch.ops.aten.mean.dim(pow_3, [-1], True);  pow_3 = None
    add_9 = torch.ops.aten.add.Tensor(mean_2, 1e-06);  mean_2 = None
    rsqrt_2 = torch.ops.aten.rsqrt.default(add_9);  add_9 = None
    mul_12 = torch.ops.aten.mul.Tensor(to_10, rsqrt_2);  rsqrt_2 = None
    to_11 = torch.ops.aten.to.dtype(mul_12, torch.float32);  mul_12 = None
    mul_13 = torch.ops.aten.mul.Tensor(p_model_layers_1_input_layernorm_weight, to_11);  p_model_layers_1_input_layernorm_weight = to_11 = None
    linear_7 = torch.ops.aten.linear.default(mul_13, p_model_layers_1_self_attn_q_proj_weight);  p_model_layers_1_self_attn_q_proj_weight = None
    view_3 = torch.ops.aten.reshape.default(linear_7, [2, 4, 4, 16]);  linear_7 = None
    transpose_4 = torch.ops.aten.transpose.int(view_3, 1, 2);  view_3 = None
    linear_8 = torch.ops.aten.linear.default(mul_13, p_model_layers_1_self_attn_k_proj_weight);  p_model_layers_1_self_attn_k_proj_weight = None
    view_4 = torch.ops.aten.reshape.default(linear_8, [2, 4, 2, 16]);  linear_8 = None
    transpose_5 = torch.ops.aten.transpose.int(view_4, 1, 2);  view_4 = None
    linear_9 = torch.ops.aten.linear.default(mul_13, p_model_layers_1_self_attn_v_proj_weight);  mul_13 = p_model_layers_1_self_attn_v_proj_weight = None
    view_5 = torch.ops.aten.reshape.default(linear_9, [2, 4, 2, 16]);  linear_9 = None
    transpose_6 = torch.ops.aten.transpose.int(view_5, 1, 2);  view_5 = None
    unsqueeze_18 = torch.ops.aten.unsqueeze.default(to_4, 1);  to_4 = None
    unsqueeze_19 = torch.ops.aten.unsqueeze.default(to_5, 1);  to_5 = None
    mul_14 = torch.ops.aten.mul.Tensor(transpose_4, unsqueeze_18)
    slice_6 = torch.ops.aten.slice.Tensor(transpose_4, 3, 0, 8)
    slice_7 = torch.ops.aten.slice.Tensor(transpose_4, 3, 8, 9223372036854775807);  transpose_4 = None
    neg_2 = torch.ops.aten.neg.default(slice_7);  slice_7 = None
    cat_3 = torch.ops.aten.cat.default([neg_2, slice_6], -1);  neg_2 = slice_6 = None
    mul_15 = torch.ops.aten.mul.Tensor(cat_3, unsqueeze_19);  cat_3 = None
    add_10 = torch.ops.aten.add.Tensor(mul_14, mul_15);  mul_14 = mul_15 = None
    mul_16 = torch.ops.aten.mul.Tensor(transpose_5, unsqueeze_18);  unsqueeze_18 = None
    slice_8 = torch.ops.aten.slice.Tensor(transpose_5, 3, 0, 8)
    slice_9 = torch.ops.aten.slice.Tensor(transpose_5, 3, 8, 9223372036854775807);  transpose_5 = None
    neg_3 = torch.ops.aten.neg.default(slice_9);  slice_9 = None
    cat_4 = torch.ops.aten.cat.default([neg_3, slice_8], -1);  neg_3 = slice_8 = None
    mul_17 = torch.ops.aten.mul.Tensor(cat_4, unsqueeze_19);  cat_4 = unsqueeze_19 = None
    add_11 = torch.ops.aten.add.Tensor(mul_16, mul_17);  mul_16 = mul_17 = None
    unsqueeze_20 = torch.ops.aten.unsqueeze.default(add_11, 2);  add_11 = None
    expand_5 = torch.ops.aten.expand.default(unsqueeze_20, [2, 2, 2, 4, 16]);  unsqueeze_20 = None
    reshape_4 = torch.ops.aten.reshape.default(expand_5, [2, 4, 4, 16]);  expand_5 = None
    unsqueeze_21 = torch.ops.aten.unsqueeze.default(transpose_6, 2);  transpose_6 = None
    expand_6 = torch.ops.aten.expand.default(unsqueeze_21, [2, 2, 2, 4, 16]);  unsqueeze_21 = None
    reshape_5 = torch.ops.aten.reshape.default(expand_6, [2, 4, 4, 16]);  expand_6 = None
    all_gather_default_4 = torch.ops.autopar.all_gather.default(reshape_4, 2, 'tp', 'reduce_scatter');  reshape_4 = None
    all_gather_default_5 = torch.ops.autopar.all_gather.default(reshape_5, 2, 'tp', 'reduce_scatter');  reshape_5 = None
    scaled_dot_product_attention_1 = torch.ops.aten.scaled_dot_product_attention.default(add_10, all_gather_default_4, all_gather_default_5, expand_2, scale = 0.25);  add_10 = all_gather_default_4 = all_gather_default_5 = expand_2 = None
    reshape_6 = torch.ops.aten.reshape.default(scaled_dot_product_attention_1, [2, 4, 4, 16]);  scaled_dot_product_attention_1 = None
    transpose_7 = torch.ops.aten.transpose.int(reshape_6, 1, 2);  reshape_6 = None
    reshape_7 = torch.ops.aten.reshape.default(transpose_7, [2, 4, 64]);  transpose_7 = None
    linear_10 = torch.ops.aten.linear.default(reshape_7, p_model_layers_1_self_attn_o_proj_weight);  reshape_7 = p_model_layers_1_self_attn_o_proj_weight = None
    add_12 = torch.ops.aten.add.Tensor(to_10, linear_10);  to_10 = linear_10 = None
    to_12 = torch.ops.aten.to.dtype(add_12, torch.float32);  add_12 = None
    pow_4 = torch.ops.aten.pow.Tensor_Scalar(to_12, 2)
    mean_3 = torch.ops.aten.mean.dim(pow_4, [-1], True);  pow_4 = None
    add_13 = torch.ops.aten.add.Tensor(mean_3, 1e-06);  mean_3 = None
    rsqrt_3 = torch.ops.aten.rsqrt.default(add_13);  add_13 = None
    mul_18 = torch.ops.aten.mul.Tensor(to_12, rsqrt_3);  rsqrt_3 = None
    to_13 = torch.ops.aten.to.dtype(mul_18, torch.float32);  mul_18 = None
    mul_19 = torch.ops.aten.mul.Tensor(p_model_layers_1_post_attention_layernorm_weight, to_13);  p_model_layers_1_post_attention_layernorm_weight = to_13 = None
    all_gather_default_6 = torch.ops.autopar.all_gather.default(mul_19, 0, 'dp', 'reduce_scatter')
    linear_11 = torch.ops.aten.linear.default(all_gather_default_6, p_model_layers_1_mlp_gate_proj_weight);  all_gather_default_6 = p_model_layers_1_mlp_gate_proj_weight = None
    silu_1 = torch.ops.aten.silu.default(linear_11);  linear_11 = None
    all_gather_default_7 = torch.ops.autopar.all_gather.default(mul_19, 0, 'dp', 'reduce_scatter');  mul_19 = None
    linear_12 = torch.ops.aten.linear.default(all_gather_default_7, p_model_layers_1_mlp_up_proj_weight);  all_gather_default_7 = p_model_layers_1_mlp_up_proj_weight = None
    mul_20 = torch.ops.aten.mul.Tensor(silu_1, linear_12);  silu_1 = linear_12 = None
    linear_13 = torch.ops.aten.linear.default(mul_20, p_model_layers_1_mlp_down_proj_weight);  mul_20 = p_model_layers_1_mlp_down_proj_weight = None
    reduce_scatter_default_2 = torch.ops.autopar.reduce_scatter.default(linear_13, 0, 'dp');  linear_13 = None
    add_14 = torch.ops.aten.add.Tensor(to_12, reduce_scatter_default_2);  to_12 = reduce_scatter_default_2 = None
    to_14 = torch.ops.aten.to.dtype(add_14, torch.float32);  add_14 = None
    pow_5 = torch.ops.aten.pow.Tensor_Scalar(to_14, 2)
    mean_4 = torch.ops.aten.mean.dim(pow_5, [-1], True);  pow_5 = None
    add_15 = torch.ops.aten.add.Tensor(mean_4, 1e-06);  mean_4 = None
    rsqrt_4 = torch.ops.aten.rsqrt.default(add_15);  add_15 = None
    mul_21 = torch.ops.aten.mul.Tensor(to_14, rsqrt_4);  to_14 = rsqrt_4 = None
    to_15 = torch.ops.aten.to.dtype(mul_21, torch.float32);  mul_21 = None
    mul_22 = torch.ops.aten.mul.Tensor(p_model_norm_weight, to_15);  p_model_norm_weight = to_15 = None
    alias = torch.ops.aten.alias.default(mul_22);  mul_22 = None
    all_to_all_default = torch.ops.autopar.all_to_all.default(alias, 1, 0, 'tp');  alias = None
    linear_14 = torch.ops.aten.linear.default(all_to_all_default, p_lm_head_weight);  all_to_all_default = p_lm_head_weight = None
    to_16 = torch.ops.aten.to.dtype(linear_14, torch.float32);  linear_14 = None
    pad = torch.ops.aten.pad.default(labels, [0, 1], 'constant', -100.0);  labels = None
    slice_10 = torch.ops.aten.slice.Tensor(pad, 1, 1, 9223372036854775807);  pad = None
    contiguous = torch.ops.aten.contiguous.default(slice_10);  slice_10 = None
    view_6 = torch.ops.aten.reshape.default(to_16, [8, 128])
    view_7 = torch.ops.aten.reshape.default(contiguous, [32]);  contiguous = None
    to_17 = torch.ops.aten.to.dtype_layout(view_7, dtype = torch.int64, layout = torch.strided, device = device(type='cpu'));  view_7 = None
    detach = torch.ops.aten.detach.default(view_6)
    amax = torch.ops.aten.amax.default(detach, [1], True);  detach = None
    sub_1 = torch.ops.aten.sub.Tensor(view_6, amax)
    exp = torch.ops.aten.exp.default(sub_1);  sub_1 = None
    sum_1 = torch.ops.aten.sum.dim_IntList(exp, [1], True);  exp = None
    log = torch.ops.aten.log.default(sum_1);  sum_1 = None
    add_16 = torch.ops.aten.add.Tensor(log, amax);  log = amax = None
    ne_1 = torch.ops.aten.ne.Scalar(to_17, -100)
    where = torch.ops.aten.where.ScalarOther(ne_1, to_17, 0);  to_17 = None
    unsqueeze_22 = torch.ops.aten.unsqueeze.default(where, 1);  where = None
    shard_default_7 = torch.ops.autopar.shard.default(unsqueeze_22, 0, 'dp');  unsqueeze_22 = None
    shard_default_8 = torch.ops.autopar.shard.default(shard_default_7, 0, 'tp');  shard_default_7 = None
    gather = torch.ops.aten.gather.default(view_6, 1, shard_default_8);  view_6 = shard_default_8 = None
    squeeze = torch.ops.aten.squeeze.dim(gather, 1);  gather = None
    to_18 = torch.ops.aten.to.dtype(ne_1, torch.float32);  ne_1 = None
    squeeze_1 = torch.ops.aten.squeeze.dim(add_16, 1);  add_16 = None
    sub_2 = torch.ops.aten.sub.Tensor(squeeze_1, squeeze);  squeeze_1 = squeeze = None
    shard_default_9 = torch.ops.autopar.shard.default(to_18, 0, 'dp')
    shard_default_10 = torch.ops.autopar.shard.default(shard_default_9, 0, 'tp');  shard_default_9 = None
    mul_23 = torch.ops.aten.mul.Tensor(sub_2, shard_default_10);  sub_2 = shard_default_10 = None
    sum_2 = torch.ops.aten.sum.default(to_18);  to_18 = None
    sum_3 = torch.ops.aten.sum.default(mul_23);  mul_23 = None
    div = torch.ops.aten.div.Tensor(sum_3, sum_2);  sum_3 = sum_2 = None
    all_reduce_default = torch.ops.autopar.all_reduce.default(div, 'dp', 'identity');  div = None
    all_reduce_default_1 = torch.ops.autopar.all_reduce.default(all_reduce_default, 'tp', 'identity');  all_reduce_default = None
    return (all_reduce_default_1, to_16)
    