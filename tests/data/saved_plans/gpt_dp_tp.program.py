# after strip_export_checks: sha256 8e8cd683a0c86ee22fcbdb8a503fe2eab5f295d0ab0670e2b5a46866b6c9e81b
# after place_on_device: sha256 79a5264cfaae4bb62f87676f6534fd5e45785f502afc60acff2178e6fe0c4cba
# after apply_plan: sha256 9e983e411f3eaf3c2b226b4028240160b3983a2bd0faf673276355c082418c68
# after insert_redistributions: sha256 0b91f447269024ab212c2640816576b552cc20c3744ecc6b69402c437f72eee8
# after lower_collectives: sha256 a2918683d9d9f300079ed15386fdc3098666087c84c827ccccd7863032ca7100
# after drop_layout_constraints: sha256 d12e2d80110f604effd0d34a98ee2f82d26f57ada888007d3539523fde2c22aa
# after localize_shapes: sha256 7d6e1a813a23172c74ae520060704d376a972c91ea3757d61a5a9795f2c55978
# after localize_lookups: sha256 59dc37fd2c49c9e554e1615669fe3b64c8ccf09edf210b8a4fd3c19d771e6b7e
# after localize_views: sha256 00d5fde72ae1e4e24e2ca165fa4b7d9ef2980701b5634d57487d75fff960227d
# after verify_layouts: sha256 b01553a010241f013f2c77f15933a9a20fadec7f13eec0df60805e8d1b8f00c6
# after check_local_program: sha256 96db6940bbafcd5b914c00f83b3f135c1366d022dfd0c03bbda92cd130c05978
# after mark_recompute: sha256 c2fc949ca6781c925f597177c576c032eee26b76c4de0c7d91822ca1598e01b2
# after apply_recompute: sha256 95f3a672c01c1cb6405209df49d18fd898145413952dd0ac817d112483429083
# after split_stages: sha256 fb20ae7ecad3d170006d3ce9eee5f52b2e332146ae6459eb31bae52d09504196
# final program



def forward(self, p_wte_weight, p_wpe_weight, p_blocks_0_ln_1_weight, p_blocks_0_ln_1_bias, p_blocks_0_attn_q_weight, p_blocks_0_attn_q_bias, p_blocks_0_attn_k_weight, p_blocks_0_attn_k_bias, p_blocks_0_attn_v_weight, p_blocks_0_attn_v_bias, p_blocks_0_attn_proj_weight, p_blocks_0_attn_proj_bias, p_blocks_0_ln_2_weight, p_blocks_0_ln_2_bias, p_blocks_0_mlp_fc_weight, p_blocks_0_mlp_fc_bias, p_blocks_0_mlp_proj_weight, p_blocks_0_mlp_proj_bias, p_blocks_1_ln_1_weight, p_blocks_1_ln_1_bias, p_blocks_1_attn_q_weight, p_blocks_1_attn_q_bias, p_blocks_1_attn_k_weight, p_blocks_1_attn_k_bias, p_blocks_1_attn_v_weight, p_blocks_1_attn_v_bias, p_blocks_1_attn_proj_weight, p_blocks_1_attn_proj_bias, p_blocks_1_ln_2_weight, p_blocks_1_ln_2_bias, p_blocks_1_mlp_fc_weight, p_blocks_1_mlp_fc_bias, p_blocks_1_mlp_proj_weight, p_blocks_1_mlp_proj_bias, p_ln_f_weight, p_ln_f_bias, p_lm_head_weight, idx):
    arange = torch.ops.aten.arange.default(16, device = device(type='cpu'), pin_memory = False)
    embedding = torch.ops.aten.embedding.default(p_wte_weight, idx);  p_wte_weight = idx = None
    shard_default = torch.ops.autopar.shard.default(arange, 0, 'tp');  arange = None
    embedding_1 = torch.ops.aten.embedding.default(p_wpe_weight, shard_default);  p_wpe_weight = shard_default = None
    add = torch.ops.aten.add.Tensor(embedding, embedding_1);  embedding = embedding_1 = None
    dropout = torch.ops.aten.dropout.default(add, 0.0, True);  add = None
    all_to_all_default = torch.ops.autopar.all_to_all.default(dropout, 2, 0, 'dp');  dropout = None
    layer_norm = torch.ops.aten.layer_norm.default(all_to_all_default, [64], p_blocks_0_ln_1_weight, p_blocks_0_ln_1_bias, 1e-05, False);  p_blocks_0_ln_1_weight = p_blocks_0_ln_1_bias = None
    all_to_all_default_1 = torch.ops.autopar.all_to_all.default(layer_norm, 1, 0, 'tp')
    linear = torch.ops.aten.linear.default(all_to_all_default_1, p_blocks_0_attn_q_weight, p_blocks_0_attn_q_bias);  all_to_all_default_1 = p_blocks_0_attn_q_weight = p_blocks_0_attn_q_bias = None
    all_to_all_default_2 = torch.ops.autopar.all_to_all.default(layer_norm, 1, 0, 'tp')
    linear_1 = torch.ops.aten.linear.default(all_to_all_default_2, p_blocks_0_attn_k_weight, p_blocks_0_attn_k_bias);  all_to_all_default_2 = p_blocks_0_attn_k_weight = p_blocks_0_attn_k_bias = None
    all_to_all_default_3 = torch.ops.autopar.all_to_all.default(layer_norm, 1, 0, 'tp');  layer_norm = None
    linear_2 = torch.ops.aten.linear.default(all_to_all_default_3, p_blocks_0_attn_v_weight, p_blocks_0_attn_v_bias);  all_to_all_default_3 = p_blocks_0_attn_v_weight = p_blocks_0_attn_v_bias = None
    view = torch.ops.aten.reshape.default(linear, [2, 16, 4, 16]);  linear = None
    transpose = torch.ops.aten.transpose.int(view, 1, 2);  view = None
    view_1 = torch.ops.aten.reshape.default(linear_1, [2, 16, 4, 16]);  linear_1 = None
    transpose_1 = torch.ops.aten.transpose.int(view_1, 1, 2);  view_1 = None
    view_2 = torch.ops.aten.reshape.default(linear_2, [2, 16, 4, 16]);  linear_2 = None
    transpose_2 = torch.ops.aten.transpose.int(view_2, 1, 2);  view_2 = None
    scaled_dot_product_attention = torch.ops.aten.scaled_dot_product_attention.default(transpose, transpose_1, transpose_2, None, 0.0, True);  transpose = transpose_1 = transpose_2 = None
    transpose_3 = torch.ops.aten.transpose.int(scaled_dot_product_attention, 1, 2);  scaled_dot_product_attention = None
    reshape = torch.ops.aten.reshape.default(transpose_3, [2, 16, 64]);  transpose_3 = None
    linear_3 = torch.ops.aten.linear.default(reshape, p_blocks_0_attn_proj_weight, p_blocks_0_attn_proj_bias);  reshape = p_blocks_0_attn_proj_weight = p_blocks_0_attn_proj_bias = None
    dropout_1 = torch.ops.aten.dropout.default(linear_3, 0.0, True);  linear_3 = None
    all_to_all_default_4 = torch.ops.autopar.all_to_all.default(dropout_1, 0, 1, 'tp');  dropout_1 = None
    add_1 = torch.ops.aten.add.Tensor(all_to_all_default, all_to_all_default_4);  all_to_all_default = all_to_all_default_4 = None
    layer_norm_1 = torch.ops.aten.layer_norm.default(add_1, [64], p_blocks_0_ln_2_weight, p_blocks_0_ln_2_bias, 1e-05, False);  p_blocks_0_ln_2_weight = p_blocks_0_ln_2_bias = None
    all_gather_default = torch.ops.autopar.all_gather.default(layer_norm_1, 0, 'dp', 'reduce_scatter');  layer_norm_1 = None
    linear_4 = torch.ops.aten.linear.default(all_gather_default, p_blocks_0_mlp_fc_weight, p_blocks_0_mlp_fc_bias);  all_gather_default = p_blocks_0_mlp_fc_weight = p_blocks_0_mlp_fc_bias = None
    gelu = torch.ops.aten.gelu.default(linear_4, approximate = 'tanh');  linear_4 = None
    all_gather_default_1 = torch.ops.autopar.all_gather.default(p_blocks_0_mlp_proj_bias, 0, 'tp', 'reduce_scatter');  p_blocks_0_mlp_proj_bias = None
    to_partial_default = torch.ops.autopar.to_partial.default(all_gather_default_1, 'dp', -1);  all_gather_default_1 = None
    linear_5 = torch.ops.aten.linear.default(gelu, p_blocks_0_mlp_proj_weight, to_partial_default);  gelu = p_blocks_0_mlp_proj_weight = to_partial_default = None
    all_reduce_default = torch.ops.autopar.all_reduce.default(linear_5, 'dp', 'identity');  linear_5 = None
    dropout_2 = torch.ops.aten.dropout.default(all_reduce_default, 0.0, True);  all_reduce_default = None
    shard_default_1 = torch.ops.autopar.shard.default(dropout_2, 0, 'dp');  dropout_2 = None
    add_2 = torch.ops.aten.add.Tensor(add_1, shard_default_1);  add_1 = shard_default_1 = None
    layer_norm_2 = torch.ops.aten.layer_norm.default(add_2, [64], p_blocks_1_ln_1_weight, p_blocks_1_ln_1_bias, 1e-05, False);  p_blocks_1_ln_1_weight = p_blocks_1_ln_1_bias = None
    all_to_all_default_5 = torch.ops.autopar.all_to_all.default(layer_norm_2, 1, 0, 'tp')
    linear_6 = torch.ops.aten.linear.default(all_to_all_default_5, p_blocks_1_attn_q_weight, p_blocks_1_attn_q_bias);  all_to_all_default_5 = p_blocks_1_attn_q_weight = p_blocks_1_attn_q_bias = None
    all_to_all_default_6 = torch.ops.autopar.all_to_all.default(layer_norm_2, 1, 0, 'tp')
    linear_7 = torch.ops.aten.linear.default(all_to_all_default_6, p_blocks_1_attn_k_weight, p_blocks_1_attn_k_bias);  all_to_all_default_6 = p_blocks_1_attn_k_weight = p_blocks_1_attn_k_bias = None
    all_to_all_default_7 = torch.ops.autopar.all_to_all.default(layer_norm_2, 1, 0, 'tp');  layer_norm_2 = None
    linear_8 = torch.ops.aten.linear.default(all_to_all_default_7, p_blocks_1_attn_v_weight, p_blocks_1_attn_v_bias);  all_to_all_default_7 = p_blocks_1_attn_v_weight = p_blocks_1_attn_v_bias = None
    view_3 = torch.ops.aten.reshape.default(linear_6, [2, 16, 4, 16]);  linear_6 = None
    transpose_4 = torch.ops.aten.transpose.int(view_3, 1, 2);  view_3 = None
    view_4 = torch.ops.aten.reshape.default(linear_7, [2, 16, 4, 16]);  linear_7 = None
    transpose_5 = torch.ops.aten.transpose.int(view_4, 1, 2);  view_4 = None
    view_5 = torch.ops.aten.reshape.default(linear_8, [2, 16, 4, 16]);  linear_8 = None
    transpose_6 = torch.ops.aten.transpose.int(view_5, 1, 2);  view_5 = None
    scaled_dot_product_attention_1 = torch.ops.aten.scaled_dot_product_attention.default(transpose_4, transpose_5, transpose_6, None, 0.0, True);  transpose_4 = transpose_5 = transpose_6 = None
    transpose_7 = torch.ops.aten.transpose.int(scaled_dot_product_attention_1, 1, 2);  scaled_dot_product_attention_1 = None
    reshape_1 = torch.ops.aten.reshape.default(transpose_7, [2, 16, 64]);  transpose_7 = None
    linear_9 = torch.ops.aten.linear.default(reshape_1, p_blocks_1_attn_proj_weight, p_blocks_1_attn_proj_bias);  reshape_1 = p_blocks_1_attn_proj_weight = p_blocks_1_attn_proj_bias = None
    dropout_3 = torch.ops.aten.dropout.default(linear_9, 0.0, True);  linear_9 = None
    all_to_all_default_8 = torch.ops.autopar.all_to_all.default(dropout_3, 0, 1, 'tp');  dropout_3 = None
    add_3 = torch.ops.aten.add.Tensor(add_2, all_to_all_default_8);  add_2 = all_to_all_default_8 = None
    layer_norm_3 = torch.ops.aten.layer_norm.default(add_3, [64], p_blocks_1_ln_2_weight, p_blocks_1_ln_2_bias, 1e-05, False);  p_blocks_1_ln_2_weight = p_blocks_1_ln_2_bias = None
    all_gather_default_2 = torch.ops.autopar.all_gather.default(layer_norm_3, 0, 'dp', 'reduce_scatter');  layer_norm_3 = None
    linear_10 = torch.ops.aten.linear.default(all_gather_default_2, p_blocks_1_mlp_fc_weight, p_blocks_1_mlp_fc_bias);  all_gather_default_2 = p_blocks_1_mlp_fc_weight = p_blocks_1_mlp_fc_bias = None
    gelu_1 = torch.ops.aten.gelu.default(linear_10, approximate = 'tanh');  linear_10 = None
    all_gather_default_3 = torch.ops.autopar.all_gather.default(p_blocks_1_mlp_proj_bias, 0, 'tp', 'reduce_scatter');  p_blocks_1_mlp_proj_bias = None
    to_partial_default_1 = torch.ops.autopar.to_partial.default(all_gather_default_3, 'dp', -1);  all_gather_default_3 = None
    linear_11 = torch.ops.aten.linear.default(gelu_1, p_blocks_1_mlp_proj_weight, to_partial_default_1);  gelu_1 = p_blocks_1_mlp_proj_weight = to_partial_default_1 = None
    all_reduce_default_1 = torch.ops.autopar.all_reduce.default(linear_11, 'dp', 'identity');  linear_11 = None
    dropout_4 = torch.ops.aten.dropout.default(all_reduce_default_1, 0.0, True);  all_reduce_default_1 = None
    shard_default_2 = torch.ops.autopar.shard.default(dropout_4, 0, 'dp');  dropout_4 = None
    add_4 = torch.ops.aten.add.Tensor(add_3, shard_default_2);  add_3 = shard_default_2 = None
    layer_norm_4 = torch.ops.aten.layer_norm.default(add_4, [64], p_ln_f_weight, p_ln_f_bias, 1e-05, False);  add_4 = p_ln_f_weight = p_ln_f_bias = None
    all_gather_default_4 = torch.ops.autopar.all_gather.default(layer_norm_4, 0, 'dp', 'reduce_scatter');  layer_norm_4 = None
    linear_12 = torch.ops.aten.linear.default(all_gather_default_4, p_lm_head_weight);  all_gather_default_4 = p_lm_head_weight = None
    return (linear_12,)
    