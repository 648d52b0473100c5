# after strip_export_checks: sha256 8e8cd683a0c86ee22fcbdb8a503fe2eab5f295d0ab0670e2b5a46866b6c9e81b
# after place_on_device: sha256 79a5264cfaae4bb62f87676f6534fd5e45785f502afc60acff2178e6fe0c4cba
# after apply_plan: sha256 7d4493e9a36ff349d5fd1af7b25cece5220a891a189d7fe99a00efe34a89135f
# after insert_redistributions: sha256 73f80de4f8258e241088bcfe0d10bc56d86f091285476d291cf9d5f4263225b1
# after lower_collectives: sha256 00087b553232fbc167ed36457eacdae63fbfbe5cb66bf7b50bd0c6001f84b491
# after drop_layout_constraints: sha256 635d2c42113cd28fc68a736ce492c8d800fb141f0d736c081cbd29e411d264c8
# after localize_shapes: sha256 f6bd6381956df0ecf575364e7b69995b9b7369c177bb73c907c98ca55e954694
# after localize_lookups: sha256 8f48cfaa84c6facdc10e0b1c2ec5d8e7a9df3d7a5e93df1587c7f710c0fae131
# after localize_views: sha256 cd3bd342c17e71d450480148bd12a516abc678d1d026ab75a69c1726a24a82d6
# after verify_layouts: sha256 0e12e1aed21e770db6c3d1032e18735989d62db6b783846c35c7891a49d7c0e7
# after check_local_program: sha256 b56c92ce69632ca621f731efc7b72fc605e957d568bef047be60071c86baebe6
# after mark_recompute: sha256 45855402229748be1e6288fe0970a47cc31910b5755459206e2ced0ae8cf92b4
# after apply_recompute: sha256 5f5e08b37f8376f73c3dba175318529581ef503f02f416817a7bea314262eed5
# after split_stages: sha256 01a636bed43b53fc11b8ebbac157eb86c3d8ee4fd5f70a46cec1014d267914f0
# final program



def forward(self, p_wte_weight, p_wpe_weight, p_blocks_0_ln_1_weight, p_blocks_0_ln_1_bias, p_blocks_0_attn_q_weight, p_blocks_0_attn_q_bias, p_blocks_0_attn_k_weight, p_blocks_0_attn_k_bias, p_blocks_0_attn_v_weight, p_blocks_0_attn_v_bias, p_blocks_0_attn_proj_weight, p_blocks_0_attn_proj_bias, p_blocks_0_ln_2_weight, p_blocks_0_ln_2_bias, p_blocks_0_mlp_fc_weight, p_blocks_0_mlp_fc_bias, p_blocks_0_mlp_proj_weight, p_blocks_0_mlp_proj_bias, p_blocks_1_ln_1_weight, p_blocks_1_ln_1_bias, p_blocks_1_attn_q_weight, p_blocks_1_attn_q_bias, p_blocks_1_attn_k_weight, p_blocks_1_attn_k_bias, p_blocks_1_attn_v_weight, p_blocks_1_attn_v_bias, p_blocks_1_attn_proj_weight, p_blocks_1_attn_proj_bias, p_blocks_1_ln_2_weight, p_blocks_1_ln_2_bias, p_blocks_1_mlp_fc_weight, p_blocks_1_mlp_fc_bias, p_blocks_1_mlp_proj_weight, p_blocks_1_mlp_proj_bias, p_ln_f_weight, p_ln_f_bias, p_lm_head_weight, idx):
    arange = torch.ops.aten.arange.default(16, device = device(type='cpu'), pin_memory = False)
    embedding = torch.ops.aten.embedding.default(p_wte_weight, idx);  p_wte_weight = idx = None
    embedding_1 = torch.ops.aten.embedding.default(p_wpe_weight, arange);  p_wpe_weight = arange = None
    add = torch.ops.aten.add.Tensor(embedding, embedding_1);  embedding = embedding_1 = None
    dropout = torch.ops.aten.dropout.default(add, 0.0, True);  add = None
    recompute_0 = self.recompute_0(dropout, p_blocks_0_ln_1_weight, p_blocks_0_ln_1_bias, p_blocks_0_attn_q_weight, p_blocks_0_attn_q_bias, p_blocks_0_attn_k_weight, p_blocks_0_attn_k_bias, p_blocks_0_attn_v_weight, p_blocks_0_attn_v_bias, p_blocks_0_attn_proj_bias, p_blocks_0_attn_proj_weight, p_blocks_0_ln_2_weight, p_blocks_0_ln_2_bias, p_blocks_0_mlp_fc_weight, p_blocks_0_mlp_fc_bias, p_blocks_0_mlp_proj_bias, p_blocks_0_mlp_proj_weight);  dropout = p_blocks_0_ln_1_weight = p_blocks_0_ln_1_bias = p_blocks_0_attn_q_weight = p_blocks_0_attn_q_bias = p_blocks_0_attn_k_weight = p_blocks_0_attn_k_bias = p_blocks_0_attn_v_weight = p_blocks_0_attn_v_bias = p_blocks_0_attn_proj_bias = p_blocks_0_attn_proj_weight = p_blocks_0_ln_2_weight = p_blocks_0_ln_2_bias = p_blocks_0_mlp_fc_weight = p_blocks_0_mlp_fc_bias = p_blocks_0_mlp_proj_bias = p_blocks_0_mlp_proj_weight = None
    add_2 = recompute_0[0];  recompute_0 = None
    recompute_1 = self.recompute_1(p_blocks_1_ln_1_weight, p_blocks_1_ln_1_bias, add_2, p_blocks_1_attn_q_weight, p_blocks_1_attn_q_bias, p_blocks_1_attn_k_weight, p_blocks_1_attn_k_bias, p_blocks_1_attn_v_weight, p_blocks_1_attn_v_bias, p_blocks_1_attn_proj_bias, p_blocks_1_attn_proj_weight, p_blocks_1_ln_2_weight, p_blocks_1_ln_2_bias, p_blocks_1_mlp_fc_weight, p_blocks_1_mlp_fc_bias, p_blocks_1_mlp_proj_bias, p_blocks_1_mlp_proj_weight);  p_blocks_1_ln_1_weight = p_blocks_1_ln_1_bias = add_2 = p_blocks_1_attn_q_weight = p_blocks_1_attn_q_bias = p_blocks_1_attn_k_weight = p_blocks_1_attn_k_bias = p_blocks_1_attn_v_weight = p_blocks_1_attn_v_bias = p_blocks_1_attn_proj_bias = p_blocks_1_attn_proj_weight = p_blocks_1_ln_2_weight = p_blocks_1_ln_2_bias = p_blocks_1_mlp_fc_weight = p_blocks_1_mlp_fc_bias = p_blocks_1_mlp_proj_bias = p_blocks_1_mlp_proj_weight = None
    add_4 = recompute_1[0];  recompute_1 = None
    all_gather_default_16 = torch.ops.autopar.all_gather.default(p_ln_f_weight, 0, 'dp', 'reduce_scatter');  p_ln_f_weight = None
    all_gather_default_17 = torch.ops.autopar.all_gather.default(p_ln_f_bias, 0, 'dp', 'reduce_scatter');  p_ln_f_bias = None
    layer_norm_4 = torch.ops.aten.layer_norm.default(add_4, [64], all_gather_default_16, all_gather_default_17, 1e-05, False);  add_4 = all_gather_default_16 = all_gather_default_17 = None
    all_gather_default_18 = torch.ops.autopar.all_gather.default(p_lm_head_weight, 0, 'dp', 'reduce_scatter');  p_lm_head_weight = None
    linear_12 = torch.ops.aten.linear.default(layer_norm_4, all_gather_default_18);  layer_norm_4 = all_gather_default_18 = None
    return (linear_12,)
    