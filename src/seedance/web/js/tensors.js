// Tensor frames of /v2/infer (docs/protocol.md, "Tensor frames"): a 16-byte little-endian
// header, the shape, the request id and the tensor's name, then the data from an 8-byte
// boundary, so that it reads as a TypedArray over the frame's own buffer, with no copy.
// The same layout as src/seedance/protocol/tensors.py.

export const TENSOR = 0x10;
const FIXED = 16;

// Triton's datatype codes, the protocol's names, and the TypedArray each reads into.
const DTYPES = [
  [1, "BOOL", Uint8Array], [2, "UINT8", Uint8Array], [3, "UINT16", Uint16Array],
  [4, "UINT32", Uint32Array], [5, "UINT64", BigUint64Array], [6, "INT8", Int8Array],
  [7, "INT16", Int16Array], [8, "INT32", Int32Array], [9, "INT64", BigInt64Array],
  // FP16: a Float16Array where the browser has one; elsewhere read into a Float32Array (a copy).
  [10, "FP16", globalThis.Float16Array ?? Uint16Array], [11, "FP32", Float32Array],
  [12, "FP64", Float64Array],
];
const BY_CODE = new Map(DTYPES.map(([code, name, type]) => [code, { code, name, type }]));
const BY_NAME = new Map(DTYPES.map(([code, name, type]) => [name, { code, name, type }]));

const encoder = new TextEncoder();
const decoder = new TextDecoder("utf-8", { fatal: true });

/** The tensor of a tensor frame: `{requestId, name, seq, dtype, shape, data}`; `data` is a
 * TypedArray over the frame's buffer (`bytes`: an ArrayBuffer or a Uint8Array over one). */
export function decodeTensor(bytes) {
  const frame = bytes instanceof Uint8Array ? bytes : new Uint8Array(bytes);
  if (frame.length < FIXED || frame[0] !== TENSOR) throw new Error("not a tensor frame");
  const view = new DataView(frame.buffer, frame.byteOffset, frame.byteLength);
  const dtype = BY_CODE.get(view.getUint8(1));
  if (!dtype) throw new Error(`tensor frame: unknown datatype code ${view.getUint8(1)}`);
  const ndim = view.getUint8(2), nameLength = view.getUint8(3);
  const idLength = view.getUint16(4, true), start = view.getUint16(6, true);
  const seq = Number(view.getBigInt64(8, true));
  const shape = [];
  for (let i = 0; i < ndim; i++) shape.push(Number(view.getBigUint64(FIXED + 8 * i, true)));
  const at = FIXED + 8 * ndim;
  const requestId = decoder.decode(frame.subarray(at, at + idLength)) || null;
  const name = decoder.decode(frame.subarray(at + idLength, at + idLength + nameLength));
  const count = shape.reduce((a, b) => a * b, 1);
  const size = count * dtype.type.BYTES_PER_ELEMENT;
  if (start + size !== frame.length) throw new Error(`tensor frame ${name}: its data is cut`);
  let offset = frame.byteOffset + start;
  let buffer = frame.buffer;
  if (offset % dtype.type.BYTES_PER_ELEMENT) { // a frame not at its buffer's start: copy it
    buffer = frame.slice(start).buffer;
    offset = 0;
  }
  let data = new dtype.type(buffer, offset, count);
  if (dtype.name === "FP16" && !globalThis.Float16Array) data = Float32Array.from(data, halfToFloat);
  return { requestId, name, seq: seq === -1 ? null : seq, dtype: dtype.name, shape, data };
}

function halfToFloat(bits) {
  const sign = bits & 0x8000 ? -1 : 1, exponent = (bits >> 10) & 0x1f, fraction = bits & 0x3ff;
  if (exponent === 0) return sign * 2 ** -14 * (fraction / 1024);
  if (exponent === 0x1f) return fraction ? NaN : sign * Infinity;
  return sign * 2 ** (exponent - 15) * (1 + fraction / 1024);
}

/** The tensor frame (a Uint8Array) of `data` (a TypedArray; its dtype from its type unless
 * `dtype` names one) with `shape` (default: one dimension). */
export function encodeTensor({ requestId = null, name, data, shape = [data.length], seq = -1, dtype }) {
  const type = dtype ? BY_NAME.get(dtype)
    : [...BY_NAME.values()].find((d) => data instanceof d.type && d.name !== "BOOL");
  if (!type) throw new Error("encodeTensor: give a TypedArray of numbers");
  const id = encoder.encode(requestId ?? ""), label = encoder.encode(name);
  const fixed = FIXED + 8 * shape.length;
  const start = (fixed + id.length + label.length + 7) & ~7;
  const frame = new Uint8Array(start + data.byteLength);
  const view = new DataView(frame.buffer);
  view.setUint8(0, TENSOR);
  view.setUint8(1, type.code);
  view.setUint8(2, shape.length);
  view.setUint8(3, label.length);
  view.setUint16(4, id.length, true);
  view.setUint16(6, start, true);
  view.setBigInt64(8, BigInt(seq), true);
  shape.forEach((size, i) => view.setBigUint64(FIXED + 8 * i, BigInt(size), true));
  frame.set(id, fixed);
  frame.set(label, fixed + id.length);
  frame.set(new Uint8Array(data.buffer, data.byteOffset, data.byteLength), start);
  return frame;
}

/** The request id and seq a tensor frame's header names (end-to-end encryption repeats them
 * outside its seal). */
export function tensorMeta(frame) {
  const view = new DataView(frame.buffer, frame.byteOffset, frame.byteLength);
  const at = FIXED + 8 * view.getUint8(2);
  const requestId = decoder.decode(frame.subarray(at, at + view.getUint16(4, true))) || null;
  const seq = Number(view.getBigInt64(8, true));
  return [requestId, seq === -1 ? null : seq];
}
