// A TypeScript client of the RewardService, on the code buf.gen.yaml generates (protoc-gen-es)
// and Connect's gRPC transport for Node: typed requests and replies, and the rich error
// details of a refused call decoded from the grpc-status-details-bin trailer.
//
//   node build/ts/client.js ADDRESS     (after buf generate and tsc; README.md shows the commands)
import { Code, ConnectError, createClient } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";
import { BadRequestSchema } from "../gen/ts/google/rpc/error_details_pb.js";
import { Stage } from "../gen/ts/leap/common/v1/common_pb.js";
import { RewardService } from "../gen/ts/leap/reward/v1/reward_pb.js";

async function main(address: string): Promise<void> {
  const transport = createGrpcTransport({ baseUrl: `http://${address}` });
  const reward = createClient(RewardService, transport);

  const ranked = await reward.rank({
    groups: [{
      taskId: "relu",
      trajectories: [
        { turns: [{ stage: Stage.PASSED, speedup: 2.0, generatedTokens: 100n }] },
        { turns: [{ stage: Stage.COMPILE, generatedTokens: 100n }] },
        { turns: [{ stage: Stage.PASSED, speedup: 1.0, generatedTokens: 100n }] },
      ],
    }],
  }, { timeoutMs: 10_000 });
  console.log("rewards:", JSON.stringify(ranked.results[0].trajectories.map((t) => t.reward)));

  try {
    await reward.rank({ groups: [] }, { timeoutMs: 10_000 });
    console.log("refused: no");
  } catch (err) {
    const error = ConnectError.from(err);
    for (const bad of error.findDetails(BadRequestSchema)) {
      for (const violation of bad.fieldViolations) {
        console.log(`refused: ${Code[error.code]} ${violation.field}: ${violation.description}`);
      }
    }
  }
}

main(process.argv[2] ?? "127.0.0.1:50053").catch((err) => {
  console.error(err);
  process.exit(1);
});
