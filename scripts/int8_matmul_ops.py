"""The int8 op choice of refit/export/quantize.py, measured: the weight matmuls of one GPT-2-small decode step
(12 x [768x2304, 768x768, 768x3072, 3072x768] + 768x50257) at batch B, one ONNX Runtime session per variant
(fp32 MatMul; MatMulInteger with per-tensor (mmint) or per-row (mmrow, the chosen scheme) activation scales;
DynamicQuantizeMatMul; MatMulNBits 8/4-bit with block size), 2 threads, interleaved rounds, best of 5.

    python scripts/int8_matmul_ops.py 32 fp32,mmint,mmrow,dqmm,nbits8-128

The last stdout line is one JSON document (random weights; the activations are random normal)."""
import sys, time, numpy as np, onnx, onnxruntime as ort
from onnx import helper as h, numpy_helper as nh, TensorProto as TP
B = int(sys.argv[1]) if len(sys.argv) > 1 else 32
rng = np.random.default_rng(0)
shapes = [(768, 2304), (768, 768), (768, 3072), (3072, 768)] * 12 + [(768, 50257)]
def model(kind, bs=32):
    nodes, inits, outs = [], [], []
    for i, (k, n) in enumerate(shapes):
        w = (rng.standard_normal((k, n)) * 0.02).astype(np.float32)
        a = "a768" if k == 768 else "a3072"; y = f"y{i}"
        if kind == "fp32":
            inits.append(nh.from_array(w, f"w{i}")); nodes.append(h.make_node("MatMul", [a, f"w{i}"], [y]))
        elif kind == "mmrow":
            s = np.abs(w).max(0) / 127; q = np.clip(np.round(w / s), -127, 127).astype(np.int8)
            inits += [nh.from_array(q, f"q{i}"), nh.from_array(s.astype(np.float32), f"s{i}")]
            if i == 0:
                inits += [nh.from_array(np.array(127, np.float32), "c127"), nh.from_array(np.array(128, np.float32), "c128"),
                          nh.from_array(np.array(128, np.uint8), "z128"), nh.from_array(np.array(1e-30, np.float32), "tiny"),
                          nh.from_array(np.array([-1], np.int64), "ax")]
            nodes += [h.make_node("Abs", [a], [f"ab{i}"]), h.make_node("ReduceMax", [f"ab{i}", "ax"], [f"mx{i}"], keepdims=1),
                      h.make_node("Max", [f"mx{i}", "tiny"], [f"mxb{i}"]),
                      h.make_node("Div", [f"mxb{i}", "c127"], [f"sc{i}"]), h.make_node("Div", [a, f"sc{i}"], [f"d{i}"]),
                      h.make_node("Round", [f"d{i}"], [f"r{i}"]), h.make_node("Add", [f"r{i}", "c128"], [f"rb{i}"]),
                      h.make_node("Cast", [f"rb{i}"], [f"aq{i}"], to=TP.UINT8),
                      h.make_node("MatMulInteger", [f"aq{i}", f"q{i}", "z128"], [f"i{i}"]),
                      h.make_node("Cast", [f"i{i}"], [f"f{i}"], to=TP.FLOAT),
                      h.make_node("Mul", [f"f{i}", f"sc{i}"], [f"m{i}"]), h.make_node("Mul", [f"m{i}", f"s{i}"], [y])]
        elif kind in ("mmint", "dqmm"):
            s = np.abs(w).max(0) / 127; q = np.clip(np.round(w / s), -127, 127).astype(np.int8)
            inits += [nh.from_array(q, f"q{i}"), nh.from_array(s.astype(np.float32), f"s{i}"), nh.from_array(np.zeros(n, np.int8), f"z{i}")]
            if kind == "dqmm":
                nodes.append(h.make_node("DynamicQuantizeMatMul", [a, f"q{i}", f"s{i}", f"z{i}"], [y], domain="com.microsoft"))
            else:
                nodes += [h.make_node("DynamicQuantizeLinear", [a], [f"aq{i}", f"as{i}", f"az{i}"]),
                          h.make_node("MatMulInteger", [f"aq{i}", f"q{i}", f"az{i}", f"z{i}"], [f"i{i}"]),
                          h.make_node("Cast", [f"i{i}"], [f"f{i}"], to=TP.FLOAT),
                          h.make_node("Mul", [f"as{i}", f"s{i}"], [f"m{i}"]), h.make_node("Mul", [f"f{i}", f"m{i}"], [y])]
        else:  # nbits8 / nbits4
            bits = 8 if kind == "nbits8" else 4
            nb = k // bs; wb = w.T.reshape(n, nb, bs)
            s = np.abs(wb).max(-1) / (127 if bits == 8 else 7)
            zp = 128 if bits == 8 else 8
            q = np.clip(np.round(wb / s[..., None]) + zp, 0, 2**bits - 1).astype(np.uint8)
            if bits == 4: q = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
            inits += [nh.from_array(q, f"q{i}"), nh.from_array(s.reshape(-1).astype(np.float32), f"s{i}")]
            nodes.append(h.make_node("MatMulNBits", [a, f"q{i}", f"s{i}"], [y], domain="com.microsoft", K=k, N=n, bits=bits, block_size=bs, accuracy_level=4))
        outs.append(h.make_tensor_value_info(y, TP.FLOAT, None))
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("a768", TP.FLOAT, [None, 768]), h.make_tensor_value_info("a3072", TP.FLOAT, [None, 3072])], outs, inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 18), h.make_opsetid("com.microsoft", 1)])
feeds = {"a768": rng.standard_normal((B, 768)).astype(np.float32), "a3072": rng.standard_normal((B, 3072)).astype(np.float32)}
so = ort.SessionOptions(); so.intra_op_num_threads = 2; so.inter_op_num_threads = 1
res = {}
kinds = sys.argv[2].split(",") if len(sys.argv) > 2 else ["fp32", "mmint", "dqmm", "nbits8-32", "nbits8-64", "nbits8-128", "nbits4-32"]
sess = {}
for kd in kinds:
    kind, _, bs = kd.partition("-")
    sess[kd] = ort.InferenceSession(model(kind, int(bs or 32)).SerializeToString(), so, providers=["CPUExecutionProvider"])
for rnd in range(3):  # interleaved rounds
    for kd, s in sess.items():
        s.run(None, feeds)
        t = []
        for _ in range(5):
            t0 = time.perf_counter(); s.run(None, feeds); t.append(time.perf_counter() - t0)
        res.setdefault(kd, []).append(min(t) * 1e3)
for kd, v in res.items():
    print(f"B={B} {kd:12s} best ms {min(v):7.2f}  rounds {[round(x,1) for x in v]}  x fp32 {min(res['fp32'])/min(v):.2f}" if 'fp32' in res else f"{kd} {min(v):.2f}")
import json
print(json.dumps({"batch": B, "best_ms": {k: round(min(v), 2) for k, v in res.items()},
                  "speedup_vs_fp32": {k: round(min(res["fp32"]) / min(v), 3) for k, v in res.items()} if "fp32" in res else None}))
