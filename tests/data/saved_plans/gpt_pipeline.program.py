# after strip_export_checks: sha256 fb77d3d7b24577414cd65410b38d2af97e8ef9366f94401eb154eeefec1904b0
# after place_on_device: sha256 f926832a7e564bca8e4a2d38e255b36ab9da6c59a92b703abf1417d90d647983
# after apply_plan: sha256 c30aecd66aca83f97f7c1e18bac8c42af22b8d21212564bc8b9102c2049b9908
# after insert_redistributions: sha256 84ea5ed94757d7dd8cbeec0d56a76b900e3e965473d3351aff8949095b932b5a
# after lower_collectives: sha256 2a7fa176c708cdb289738d410eb4d07d63c692f10b677b89c520fd21c136d5f7
# after drop_layout_constraints: sha256 1fe459d4571a2aa9a25dcba5a818029d8ecc084c31097b7f80de4112f95651ce
# after localize_shapes: sha256 628807c3bee02974d7973b1cc77cef816696438b1f5b77f07e5889b80d251bf2
# after localize_lookups: sha256 40d4e9d72e681262a09179845d97b7070baf9c4d021e2954f4993d8ec9a4fbce
# after localize_views: sha256 d90723f73ffe5dfe03b2a48ef0b516cfec36ea27b5b06722b0b5fe150b8a8779
# after verify_layouts: sha256 dd15509db59af87ee3e96e294015997b16297280810ca01f210e8a07b59df2d7
# after check_local_program: sha256 70df84fd06a5fbe356e704d239c559c326bad5ce16bcdfce7ac18c2d0c7e2a25
# after mark_recompute: sha256 0d417c47473ba12f563319063d45bda3ff31f399182c49c1c5f5de557e0c130a
# after apply_recompute: sha256 b17d5777a2ace18ee9ddefbda07d9ea661594e95b0ce65ca4abcf20121b4905d
# after split_stages: sha256 57d582136a8b0246f7bf2968d9f55e5a969d3c401fe1f558fa04a8bd66aa2998
# final program



def forward(self, p_wte_weight, p_wpe_weight, p_blocks_0_ln_1_weight, p_blocks_0_ln_1_bias, p_blocks_0_attn_q_weight, p_blocks_0_attn_q_bias, p_blocks_0_attn_k_weight, p_blocks_0_attn_k_bias, p_blocks_0_attn_v_weight, p_blocks_0_attn_v_bias, p_blocks_0_attn_proj_weight, p_blocks_0_attn_proj_bias, p_blocks_0_ln_2_weight, p_blocks_0_ln_2_bias, p_blocks_0_mlp_fc_weight, p_blocks_0_mlp_fc_bias, p_blocks_0_mlp_proj_weight, p_blocks_0_mlp_proj_bias, p_blocks_1_ln_1_weight, p_blocks_1_ln_1_bias, p_blocks_1_attn_q_weight, p_blocks_1_attn_q_bias, p_blocks_1_attn_k_weight, p_blocks_1_attn_k_bias, p_blocks_1_attn_v_weight, p_blocks_1_attn_v_bias, p_blocks_1_attn_proj_weight, p_blocks_1_attn_proj_bias, p_blocks_1_ln_2_weight, p_blocks_1_ln_2_bias, p_blocks_1_mlp_fc_weight, p_blocks_1_mlp_fc_bias, p_blocks_1_mlp_proj_weight, p_blocks_1_mlp_proj_bias, p_ln_f_weight, p_ln_f_bias, p_lm_head_weight, idx):
    arange = torch.ops.aten.arange.default(16, device = device(type='cpu'), pin_memory = False)
    embedding = torch.ops.aten.embedding.default(p_wte_weight, idx);  p_wte_weight = idx = None
    shard_default = torch.ops.autopar.shard.default(arange, 0, 'dp');  arange = None
    embedding_1 = torch.ops.aten.embedding.default(p_wpe_weight, shard_default);  p_wpe_weight = shard_default = None
    all_gather_default = torch.ops.autopar.all_gather.default(embedding_1, 0, 'dp', 'reduce_scatter');  embedding_1 = None
    add = torch.ops.aten.add.Tensor(embedding, all_gather_default);  embedding = all_gather_default = None
    dropout = torch.ops.aten.dropout.default(add, 0.0, True);  add = None
    layer_norm = torch.ops.aten.layer_norm.default(dropout, [64], p_blocks_0_ln_1_weight, p_blocks_0_ln_1_bias, 1e-05, False);  p_blocks_0_ln_1_weight = p_blocks_0_ln_1_bias = None
    linear = torch.ops.aten.linear.default(layer_norm, p_blocks_0_attn_q_weight, p_blocks_0_attn_q_bias);  p_blocks_0_attn_q_weight = p_blocks_0_attn_q_bias = None
    linear_1 = torch.ops.aten.linear.default(layer_norm, p_blocks_0_attn_k_weight, p_blocks_0_attn_k_bias);  p_blocks_0_attn_k_weight = p_blocks_0_attn_k_bias = None
    linear_2 = torch.ops.aten.linear.default(layer_norm, p_blocks_0_attn_v_weight, p_blocks_0_attn_v_bias);  layer_norm = p_blocks_0_attn_v_weight = p_blocks_0_attn_v_bias = None
    view = torch.ops.aten.reshape.default(linear, [1, 16, 4, 16]);  linear = None
    transpose = torch.ops.aten.transpose.int(view, 1, 2);  view = None
    view_1 = torch.ops.aten.reshape.default(linear_1, [1, 16, 4, 16]);  linear_1 = None
    transpose_1 = torch.ops.aten.transpose.int(view_1, 1, 2);  view_1 = None
    view_2 = torch.ops.aten.reshape.default(linear_2, [1, 16, 4, 16]);  linear_2 = None
    transpose_2 = torch.ops.aten.transpose.int(view_2, 1, 2);  view_2 = None
    scaled_dot_product_attention = torch.ops.aten.scaled_dot_product_attention.default(transpose, transpose_1, transpose_2, None, 0.0, True);  transpose = transpose_1 = transpose_2 = None
    transpose_3 = torch.ops.aten.transpose.int(scaled_dot_product_attention, 1, 2);  scaled_dot_product_attention = None
    reshape = torch.ops.aten.reshape.default(transpose_3, [1, 16, 64]);  transpose_3 = None
    linear_3 = torch.ops.aten.linear.default(reshape, p_blocks_0_attn_proj_weight, p_blocks_0_attn_proj_bias);  reshape = p_blocks_0_attn_proj_weight = p_blocks_0_attn_proj_bias = None
    dropout_1 = torch.ops.aten.dropout.default(linear_3, 0.0, True);  linear_3 = None
    add_1 = torch.ops.aten.add.Tensor(dropout, dropout_1);  dropout = dropout_1 = None
    layer_norm_1 = torch.ops.aten.layer_norm.default(add_1, [64], p_blocks_0_ln_2_weight, p_blocks_0_ln_2_bias, 1e-05, False);  p_blocks_0_ln_2_weight = p_blocks_0_ln_2_bias = None
    linear_4 = torch.ops.aten.linear.default(layer_norm_1, p_blocks_0_mlp_fc_weight, p_blocks_0_mlp_fc_bias);  layer_norm_1 = p_blocks_0_mlp_fc_weight = p_blocks_0_mlp_fc_bias = None
    gelu = torch.ops.aten.gelu.default(linear_4, approximate = 'tanh');  linear_4 = None
    linear_5 = torch.ops.aten.linear.default(gelu, p_blocks_0_mlp_proj_weight, p_blocks_0_mlp_proj_bias);  gelu = p_blocks_0_mlp_proj_weight = p_blocks_0_mlp_proj_bias = None
    dropout_2 = torch.ops.aten.dropout.default(linear_5, 0.0, True);  linear_5 = None
    add_2 = torch.ops.aten.add.Tensor(add_1, dropout_2);  add_1 = dropout_2 = None
    layer_norm_2 = torch.ops.aten.layer_norm.default(add_2, [64], p_blocks_1_ln_1_weight, p_blocks_1_ln_1_bias, 1e-05, False);  p_blocks_1_ln_1_weight = p_blocks_1_ln_1_bias = None
    linear_6 = torch.ops.aten.linear.default(layer_norm_2, p_blocks_1_attn_q_weight, p_blocks_1_attn_q_bias);  p_blocks_1_attn_q_weight = p_blocks_1_attn_q_bias = None
    linear_7 = torch.ops.aten.linear.default(layer_norm_2, p_blocks_1_attn_k_weight, p_blocks_1_attn_k_bias);  p_blocks_1_attn_k_weight = p_blocks_1_attn_k_bias = None
    linear_8 = torch.ops.aten.linear.default(layer_norm_2, p_blocks_1_attn_v_weight, p_blocks_1_attn_v_bias);  layer_norm_2 = p_blocks_1_attn_v_weight = p_blocks_1_attn_v_bias = None
    view_3 = torch.ops.aten.reshape.default(linear_6, [1, 16, 4, 16]);  linear_6 = None
    transpose_4 = torch.ops.aten.transpose.int(view_3, 1, 2);  view_3 = None
    view_4 = torch.ops.aten.reshape.default(linear_7, [1, 16, 4, 16]);  linear_7 = None
    transpose_5 = torch.ops.aten.transpose.int(view_4, 1, 2);  view_4 = None
    view_5 = torch.ops.aten.reshape.default(linear_8, [1, 16, 4, 16]);  linear_8 = None
    transpose_6 = torch.ops.aten.transpose.int(view_5, 1, 2);  view_5 = None
    scaled_dot_product_attention_1 = torch.ops.aten.scaled_dot_product_attention.default(transpose_4, transpose_5, transpose_6, None, 0.0, True);  transpose_4 = transpose_5 = transpose_6 = None
    transpose_7 = torch.ops.aten.transpose.int(scaled_dot_product_attention_1, 1, 2);  scaled_dot_product_attention_1 = None
    reshape_1 = torch.ops.aten.reshape.default(transpose_7, [1, 16, 64]);  transpose_7 = None
    linear_9 = torch.ops.aten.linear.default(reshape_1, p_blocks_1_attn_proj_weight, p_blocks_1_attn_proj_bias);  reshape_1 = p_blocks_1_attn_proj_weight = p_blocks_1_attn_proj_bias = None
    dropout_3 = torch.ops.aten.dropout.default(linear_9, 0.0, True);  linear_9 = None
    add_3 = torch.ops.aten.add.Tensor(add_2, dropout_3);  add_2 = dropout_3 = None
    layer_norm_3 = torch.ops.aten.layer_norm.default(add_3, [64], p_blocks_1_ln_2_weight, p_blocks_1_ln_2_bias, 1e-05, False);  p_blocks_1_ln_2_weight = p_blocks_1_ln_2_bias = None
    linear_10 = torch.ops.aten.linear.default(layer_norm_3, p_blocks_1_mlp_fc_weight, p_blocks_1_mlp_fc_bias);  layer_norm_3 = p_blocks_1_mlp_fc_weight = p_blocks_1_mlp_fc_bias = None
    gelu_1 = torch.ops.aten.gelu.default(linear_10, approximate = 'tanh');  linear_10 = None
    linear_11 = torch.ops.aten.linear.default(gelu_1, p_blocks_1_mlp_proj_weight, p_blocks_1_mlp_proj_bias);  gelu_1 = p_blocks_1_mlp_proj_weight = p_blocks_1_mlp_proj_bias = None
    dropout_4 = torch.ops.aten.dropout.default(linear_11, 0.0, True);  linear_11 = None
    add_4 = torch.ops.aten.add.Tensor(add_3, dropout_4);  add_3 = dropout_4 = None
    layer_norm_4 = torch.ops.aten.layer_norm.default(add_4, [64], p_ln_f_weight, p_ln_f_bias, 1e-05, False);  add_4 = p_ln_f_weight = p_ln_f_bias = None
    linear_12 = torch.ops.aten.linear.default(layer_norm_4, p_lm_head_weight);  layer_norm_4 = p_lm_head_weight = None
    return (linear_12,)
    
# stage 0



def forward(self, idx, p_wte_weight, p_wpe_weight, p_blocks_0_ln_1_weight, p_blocks_0_ln_1_bias, p_blocks_0_attn_q_weight, p_blocks_0_attn_q_bias, p_blocks_0_attn_k_weight, p_blocks_0_attn_k_bias, p_blocks_0_attn_v_weight, p_blocks_0_attn_v_bias, p_blocks_0_attn_proj_weight, p_blocks_0_attn_proj_bias, p_blocks_0_ln_2_weight, p_blocks_0_ln_2_bias, p_blocks_0_mlp_fc_weight, p_blocks_0_mlp_fc_bias, p_blocks_0_mlp_proj_weight, p_blocks_0_mlp_proj_bias):
    arange = torch.ops.aten.arange.default(16, device = device(type='cpu'), pin_memory = False)
    embedding = torch.ops.aten.embedding.default(p_wte_weight, idx);  p_wte_weight = idx = None
    shard_default = torch.ops.autopar.shard.default(arange, 0, 'dp');  arange = None
    embedding_1 = torch.ops.aten.embedding.default(p_wpe_weight, shard_default);  p_wpe_weight = shard_default = None
    all_gather_default = torch.ops.autopar.all_gather.default(embedding_1, 0, 'dp', 'reduce_scatter');  embedding_1 = None
    add = torch.ops.aten.add.Tensor(embedding, all_gather_default);  embedding = all_gather_default = None
    dropout = torch.ops.aten.dropout.default(add, 0.0, True);  add = None
    layer_norm = torch.ops.aten.layer_norm.default(dropout, [64], p_blocks_0_ln_1_weight, p_blocks_0_ln_1_bias, 1e-05, False);  p_blocks_0_ln_1_weight = p_blocks_0_ln_1_bias = None
    linear = torch.ops.aten.linear.default(layer_norm, p_blocks_0_attn_q_weight, p_blocks_0_attn_q_bias);  p_blocks_0_attn_q_weight = p_blocks_0_attn_q_bias = None
    linear_1 = torch.ops.aten.linear.default(layer_norm, p_blocks_0_attn_k_weight, p_blocks_0_attn_k_bias);  p_blocks_0_attn_k_weight = p_blocks_0_attn_k_bias = None
    linear_2 = torch.ops.aten.linear.default(layer_norm, p_blocks_0_attn_v_weight, p_blocks_0_attn_v_bias);  layer_norm = p_blocks_0_attn_v_weight = p_blocks_0_attn_v_bias = None
    view = torch.ops.aten.reshape.default(linear, [1, 16, 4, 16]);  linear = None
    transpose = torch.ops.aten.transpose.int(view, 1, 2);  view = None
    view_1 = torch.ops.aten.reshape.default(linear_1, [1, 16, 4, 16]);  linear_1 = None
    transpose_1 = torch.ops.aten.transpose.int(view_1, 1, 2);  view_1 = None
    view_2 = torch.ops.aten.reshape.default(linear_2, [1, 16, 4, 16]);  linear_2 = None
    transpose_2 = torch.ops.aten.transpose.int(view_2, 1, 2);  view_2 = None
    scaled_dot_product_attention = torch.ops.aten.scaled_dot_product_attention.default(transpose, transpose_1, transpose_2, None, 0.0, True);  transpose = transpose_1 = transpose_2 = None
    transpose_3 = torch.ops.aten.transpose.int(scaled_dot_product_attention, 1, 2);  scaled_dot_product_attention = None
    reshape = torch.ops.aten.reshape.default(transpose_3, [1, 16, 64]);  transpose_3 = None
    linear_3 = torch.ops.aten.linear.default(reshape, p_blocks_0_attn_proj_weight, p_blocks_0_attn_proj_bias);  reshape = p_blocks_0_attn_proj_weight = p_blocks_0_attn_proj_bias = None
    dropout_1 = torch.ops.aten.dropout.default(linear_3, 0.0, True);  linear_3 = None
    add_1 = torch.ops.aten.add.Tensor(dropout, dropout_1);  dropout = dropout_1 = None
    layer_norm_1 = torch.ops.aten.layer_norm.default(add_1, [64], p_blocks_0_ln_2_weight, p_blocks_0_ln_2_bias, 1e-05, False);  p_blocks_0_ln_2_weight = p_blocks_0_ln_2_bias = None
    linear_4 = torch.ops.aten.linear.default(layer_norm_1, p_blocks_0_mlp_fc_weight, p_blocks_0_mlp_fc_bias);  layer_norm_1 = p_blocks_0_mlp_fc_weight = p_blocks_0_mlp_fc_bias = None
    gelu = torch.ops.aten.gelu.default(linear_4, approximate = 'tanh');  linear_4 = None
    linear_5 = torch.ops.aten.linear.default(gelu, p_blocks_0_mlp_proj_weight, p_blocks_0_mlp_proj_bias);  gelu = p_blocks_0_mlp_proj_weight = p_blocks_0_mlp_proj_bias = None
    dropout_2 = torch.ops.aten.dropout.default(linear_5, 0.0, True);  linear_5 = None
    add_2 = torch.ops.aten.add.Tensor(add_1, dropout_2);  add_1 = dropout_2 = None
    return (add_2,)
    
# stage 1



def forward(self, add_2, p_blocks_1_ln_1_weight, p_blocks_1_ln_1_bias, p_blocks_1_attn_q_weight, p_blocks_1_attn_q_bias, p_blocks_1_attn_k_weight, p_blocks_1_attn_k_bias, p_blocks_1_attn_v_weight, p_blocks_1_attn_v_bias, p_blocks_1_attn_proj_weight, p_blocks_1_attn_proj_bias, p_blocks_1_ln_2_weight, p_blocks_1_ln_2_bias, p_blocks_1_mlp_fc_weight, p_blocks_1_mlp_fc_bias, p_blocks_1_mlp_proj_weight, p_blocks_1_mlp_proj_bias, p_ln_f_weight, p_ln_f_bias, p_lm_head_weight):
    layer_norm_2 = torch.ops.aten.layer_norm.default(add_2, [64], p_blocks_1_ln_1_weight, p_blocks_1_ln_1_bias, 1e-05, False);  p_blocks_1_ln_1_weight = p_blocks_1_ln_1_bias = None
    linear_6 = torch.ops.aten.linear.default(layer_norm_2, p_blocks_1_attn_q_weight, p_blocks_1_attn_q_bias);  p_blocks_1_attn_q_weight = p_blocks_1_attn_q_bias = None
    linear_7 = torch.ops.aten.linear.default(layer_norm_2, p_blocks_1_attn_k_weight, p_blocks_1_attn_k_bias);  p_blocks_1_attn_k_weight = p_blocks_1_attn_k_bias = None
    linear_8 = torch.ops.aten.linear.default(layer_norm_2, p_blocks_1_attn_v_weight, p_blocks_1_attn_v_bias);  layer_norm_2 = p_blocks_1_attn_v_weight = p_blocks_1_attn_v_bias = None
    view_3 = torch.ops.aten.reshape.default(linear_6, [1, 16, 4, 16]);  linear_6 = None
    transpose_4 = torch.ops.aten.transpose.int(view_3, 1, 2);  view_3 = None
    view_4 = torch.ops.aten.reshape.default(linear_7, [1, 16, 4, 16]);  linear_7 = None
    transpose_5 = torch.ops.aten.transpose.int(view_4, 1, 2);  view_4 = None
    view_5 = torch.ops.aten.reshape.default(linear_8, [1, 16, 4, 16]);  linear_8 = None
    transpose_6 = torch.ops.aten.transpose.int(view_5, 1, 2);  view_5 = None
    scaled_dot_product_attention_1 = torch.ops.aten.scaled_dot_product_attention.default(transpose_4, transpose_5, transpose_6, None, 0.0, True);  transpose_4 = transpose_5 = transpose_6 = None
    transpose_7 = torch.ops.aten.transpose.int(scaled_dot_product_attention_1, 1, 2);  scaled_dot_product_attention_1 = None
    reshape_1 = torch.ops.aten.reshape.default(transpose_7, [1, 16, 64]);  transpose_7 = None
    linear_9 = torch.ops.aten.linear.default(reshape_1, p_blocks_1_attn_proj_weight, p_blocks_1_attn_proj_bias);  reshape_1 = p_blocks_1_attn_proj_weight = p_blocks_1_attn_proj_bias = None
    dropout_3 = torch.ops.aten.dropout.default(linear_9, 0.0, True);  linear_9 = None
    add_3 = torch.ops.aten.add.Tensor(add_2, dropout_3);  add_2 = dropout_3 = None
    layer_norm_3 = torch.ops.aten.layer_norm.default(add_3, [64], p_blocks_1_ln_2_weight, p_blocks_1_ln_2_bias, 1e-05, False);  p_blocks_1_ln_2_weight = p_blocks_1_ln_2_bias = None
    linear_10 = torch.ops.aten.linear.default(layer_norm_3, p_blocks_1_mlp_fc_weight, p_blocks_1_mlp_fc_bias);  layer_norm_3 = p_blocks_1_mlp_fc_weight = p_blocks_1_mlp_fc_bias = None
    gelu_1 = torch.ops.aten.gelu.default(linear_10, approximate = 'tanh');  linear_10 = None
    linear_11 = torch.ops.aten.linear.default(gelu_1, p_blocks_1_mlp_proj_weight, p_blocks_1_mlp_proj_bias);  gelu_1 = p_blocks_1_mlp_proj_weight = p_blocks_1_mlp_proj_bias = None
    dropout_4 = torch.ops.aten.dropout.default(linear_11, 0.0, True);  linear_11 = None
    add_4 = torch.ops.aten.add.Tensor(add_3, dropout_4);  add_3 = dropout_4 = None
    layer_norm_4 = torch.ops.aten.layer_norm.default(add_4, [64], p_ln_f_weight, p_ln_f_bias, 1e-05, False);  add_4 = p_ln_f_weight = p_ln_f_bias = None
    linear_12 = torch.ops.aten.linear.default(layer_norm_4, p_lm_head_weight);  layer_norm_4 = p_lm_head_weight = None
    return (linear_12,)
    