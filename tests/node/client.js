// A Node.js client of a LEAP service, built only from the .proto files in protos/ (the
// contracts and googleapis' google/rpc protos beside them, for rich error details) plus the
// standard health proto.
//
//   node client.js ADDRESS
//
// Prints one JSON object: the health status, the reply of RewardService.Rank on a small
// group, and the decoded status of a Rank call with no groups (INVALID_ARGUMENT + BadRequest).
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const [address] = process.argv.slice(2);
const protosDir = path.resolve(__dirname, "..", "..", "protos");
const healthDir = path.dirname(require.resolve("grpc-health-check/proto/health/v1/health.proto"));
const options = { keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true };

function load(file, includeDirs) {
  return grpc.loadPackageDefinition(protoLoader.loadSync(file, { ...options, includeDirs }));
}

const leap = load("leap/reward/v1/reward.proto", [protosDir]).leap;
const health = load("health.proto", [healthDir]).grpc.health.v1;
const rpcStatus = protoLoader.loadSync(["google/rpc/status.proto", "google/rpc/error_details.proto"], {
  ...options, includeDirs: [protosDir],
});
const root = grpc.loadPackageDefinition(rpcStatus);

function call(client, method, request) {
  return new Promise((resolve) => {
    client[method](request, { deadline: Date.now() + 10000 }, (error, reply) => resolve({ error, reply }));
  });
}

// Decodes the google.rpc.Status in the grpc-status-details-bin trailer.
function richDetails(error) {
  const raw = error.metadata && error.metadata.get("grpc-status-details-bin")[0];
  if (!raw) return [];
  const status = root.google.rpc.Status.deserialize(raw);
  return status.details.map((any) => {
    const typeName = any.type_url.split("/").pop();
    const type = root.google.rpc[typeName.replace("google.rpc.", "")];
    return { type: typeName, value: type ? type.deserialize(any.value) : null };
  });
}

async function main() {
  const out = {};
  const healthClient = new health.Health(address, grpc.credentials.createInsecure());
  const h = await call(healthClient, "Check", { service: "" });
  out.health = h.error ? `error ${h.error.code}` : h.reply.status;

  const reward = new leap.reward.v1.RewardService(address, grpc.credentials.createInsecure());
  const group = {
    task_id: "relu",
    trajectories: [
      { turns: [{ stage: "STAGE_PASSED", speedup: 2.0, generated_tokens: 100 }] },
      { turns: [{ stage: "STAGE_COMPILE", generated_tokens: 100 }] },
      { turns: [{ stage: "STAGE_PASSED", speedup: 1.0, generated_tokens: 100 }] },
    ],
  };
  const ranked = await call(reward, "Rank", { groups: [group] });
  out.rank = ranked.error ? { code: grpc.status[ranked.error.code], details: ranked.error.details } : ranked.reply;

  const bad = await call(reward, "Rank", { groups: [] });
  out.bad = bad.error
    ? { code: grpc.status[bad.error.code], details: bad.error.details, rich: richDetails(bad.error) }
    : { code: "OK" };
  console.log(JSON.stringify(out));
  healthClient.close();
  reward.close();
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
