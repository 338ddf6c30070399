"""Simulations of the GEMM kernels' index math in NumPy (no GPU needed): how the kernels were
checked before they first ran.

* mma_addressing: the rebuilt mma main loop's fixed per-thread chunk maps and XOR/immediate
  ldmatrix addressing for 64- and 128-byte K tiles, all conflict-free (every tile configuration);
* mma: cp.async chunk placement with the XOR swizzles, ldmatrix (.trans) semantics, the
  mma.m16n8k16 / m16n8k8 / m16n8k32 fragment layouts (PTX ISA), the epilogue mapping, for every operand
  layout and element size (int8, fp16/bf16, fp32) with 64-byte K tiles (the first mma kernel's
  tiles; today its checked load path's chunk mapping); counts shared-memory bank conflicts
  (ldmatrix phases, cp.async phases, scalar TF32 loads): all zero.
* gemv_mma: the permuted k order that lets 16-byte loads be mma fragments.
* SIMT: SimtTile (both run directions, edges) and the warp_tiled thread mapping, single and dual.
* reduce-scatter: the lane/index mapping of gemv.cu's warp reduce-scatter.

    python scripts/gemm_layout_sim.py [mma|mma_addressing|gemv_mma|simt|reduce_scatter ...] [int8]
"""
import sys

import numpy as np


def sim_mma():


    def kmajor_off(r,c): return r*64 + ((c ^ ((r>>1)&3))<<4)
    def mnmajor_off(EL,r,c,cpr):
        x = (r & 7) if EL==2 else ((r & 3)<<1)
        return r*cpr*16 + ((c ^ x)<<4)

    conf = {"ldm":0,"ldm_n":0,"cp":0,"cp_n":0,"lds":0,"lds_n":0}
    def bank_groups_conflict(addrs16):
        # 8 addresses of 16B -> distinct 16B slots within 128B window -> no conflict
        slots=[(a%128)//16 for a in addrs16]
        return len(set(slots))<len(slots)

    class Smem:
        def __init__(s, n): s.b=bytearray(n)
        def st16(s, off, data): s.b[off:off+16]=data
        def ld(s, off, n): return bytes(s.b[off:off+n])

    def run(EL, BM, BN, WM, WN, AK, BKM, M, N, K, aligned=True, seed=0):
        rng=np.random.default_rng(seed)
        dt = {1: np.int8, 2: np.float16, 4: np.float32}[EL]
        A=rng.integers(-3,4,(M,K)).astype(dt); B=rng.integers(-3,4,(K,N)).astype(dt)
        NT=WM*WN*32; EPC=16//EL; BK=64//EL; KS={1: 32, 2: 16, 4: 8}[EL]
        def tile_info(ROWS, KMAJOR):
            CPR = 4 if KMAJOR else ROWS*EL//16
            return CPR, ROWS*4, ROWS*64
        cprA, chA, bytesA = tile_info(BM, AK); cprB, chB, bytesB = tile_info(BN, BKM)
        assert chA % NT == 0 and NT % cprA == 0 and chB % NT==0 and NT % cprB == 0
        # operand views: A rows m, k ; B^T rows n, k
        def get(X, row, k):  # X[row][k] logical
            return X[row,k]
        Aop=lambda r,k: A[r,k]; Bop=lambda r,k: B[k,r]
        acc=np.zeros((BM,BN))
        ktiles=(K+BK-1)//BK
        for kt in range(ktiles):
            k0=kt*BK
            sm=Smem(bytesA+bytesB)
            for (base, ROWS, R, KMAJOR, cpr, nch, op) in ((0,BM,M,AK,cprA,chA,Aop),(bytesA,BN,N,BKM,cprB,chB,Bop)):
                # per thread chunk loads, check bank conflicts per 8-thread phase of one "instruction"
                per=nch//NT
                for i in range(per):
                    offs=[]
                    for tid in range(NT):
                        q=tid+i*NT; r=q//cpr; c=q%cpr
                        if KMAJOR:
                            row=r; k=k0+c*EPC; n = (K-k) if row<R else 0; off=kmajor_off(r,c)
                            elems=[op(row,k+j) if j<n else 0 for j in range(EPC)]
                        else:
                            k=k0+r; row=c*EPC; n=(R-row) if k<K else 0; off=mnmajor_off(EL,r,c,cpr)
                            elems=[op(row+j,k) if j<n else 0 for j in range(EPC)]
                        sm.st16(base+off, np.array(elems,dtype=dt).tobytes())
                        offs.append(base+off)
                    for ph in range(0,NT,8):
                        conf["cp_n"]+=1
                        if bank_groups_conflict(offs[ph:ph+8]): conf["cp"]+=1
            # fragments
            def ldmatrix(addrs, trans):
                # addrs[lane] = byte address of row (lane%8) of matrix lane//8
                regs=[[0]*4 for _ in range(32)]
                for i in range(4):
                    rows=[addrs[8*i+j] for j in range(8)]
                    conf["ldm_n"]+=1
                    if bank_groups_conflict(rows): conf["ldm"]+=1
                    mat=np.array([np.frombuffer(sm.ld(a,16),dtype=np.uint16) for a in rows])  # 8x8 b16
                    for l in range(32):
                        if not trans:
                            lo,hi=mat[l//4,2*(l%4)],mat[l//4,2*(l%4)+1]
                        else:
                            lo,hi=mat[2*(l%4),l//4],mat[2*(l%4)+1,l//4]
                        regs[l][i]=int(lo)|(int(hi)<<16)
                return regs
            def lds32(addr_per_lane):
                conf["lds_n"]+=1
                banks=[(a//4)%32 for a in addr_per_lane]
                # conflict if two distinct addresses same bank
                d={}
                for a,bk in zip(addr_per_lane,banks): d.setdefault(bk,set()).add(a)
                if any(len(v)>1 for v in d.values()): conf["lds"]+=1
                return [int(np.frombuffer(sm.ld(a,4),dtype=np.uint32)[0]) for a in addr_per_lane]
            def a_frag(m_base, kk):
                if AK:
                    addrs=[kmajor_off(m_base+(l&7)+((l>>3)&1)*8, kk*2+(l>>4)) for l in range(32)]
                    return ldmatrix(addrs, False)
                elif EL==2:
                    addrs=[mnmajor_off(2, kk*16+(l&7)+(l>>4)*8, (m_base+((l>>3)&1)*8)//8, cprA) for l in range(32)]
                    return ldmatrix(addrs, True)
                else:
                    regs=[[0]*4 for _ in range(32)]
                    for i in range(4):
                        addr=[]
                        for l in range(32):
                            g,t=l>>2,l&3; m=m_base+g+(i&1)*8; r=kk*8+t+(i>>1)*4
                            addr.append(mnmajor_off(4,r,m//4,cprA)+(m%4)*4)
                        vals=lds32(addr)
                        for l in range(32): regs[l][i]=vals[l]
                    return regs
            def b_frag2(n_base, kk):
                if BKM:
                    addrs=[bytesA+kmajor_off(n_base+(l&7)+(l>>4)*8, kk*2+((l>>3)&1)) for l in range(32)]
                    return ldmatrix(addrs, False)
                elif EL==2:
                    addrs=[bytesA+mnmajor_off(2, kk*16+(l&7)+((l>>3)&1)*8, (n_base+(l>>4)*8)//8, cprB) for l in range(32)]
                    return ldmatrix(addrs, True)
                else:
                    regs=[[0]*4 for _ in range(32)]
                    for i in range(4):
                        addr=[]
                        for l in range(32):
                            g,t=l>>2,l&3; n=n_base+g+(i>>1)*8; r=kk*8+t+(i&1)*4
                            addr.append(bytesA+mnmajor_off(4,r,n//4,cprB)+(n%4)*4)
                        vals=lds32(addr)
                        for l in range(32): regs[l][i]=vals[l]
                    return regs
            def unpack(reg):
                if EL==1:
                    return np.frombuffer(np.array([reg],dtype=np.uint32).tobytes(),dtype=np.int8).astype(float)
                if EL==2:
                    return np.frombuffer(np.array([reg],dtype=np.uint32).tobytes(),dtype=np.float16).astype(float)
                return np.frombuffer(np.array([reg],dtype=np.uint32).tobytes(),dtype=np.float32).astype(float)
            def mma(Dtile, af, b0, b1):
                # af[lane] 4 regs, b0/b1 per lane
                if EL==1:
                    Am=np.zeros((16,32)); Bm=np.zeros((32,8))
                    for l in range(32):
                        g,t=l>>2,l&3
                        Am[g,4*t:4*t+4]=unpack(af[l][0]); Am[g+8,4*t:4*t+4]=unpack(af[l][1])
                        Am[g,4*t+16:4*t+20]=unpack(af[l][2]); Am[g+8,4*t+16:4*t+20]=unpack(af[l][3])
                        Bm[4*t:4*t+4,g]=unpack(b0[l]); Bm[4*t+16:4*t+20,g]=unpack(b1[l])
                elif EL==2:
                    Am=np.zeros((16,16)); Bm=np.zeros((16,8))
                    for l in range(32):
                        g,t=l>>2,l&3
                        Am[g,2*t:2*t+2]=unpack(af[l][0]); Am[g+8,2*t:2*t+2]=unpack(af[l][1])
                        Am[g,2*t+8:2*t+10]=unpack(af[l][2]); Am[g+8,2*t+8:2*t+10]=unpack(af[l][3])
                        Bm[2*t:2*t+2,g]=unpack(b0[l]); Bm[2*t+8:2*t+10,g]=unpack(b1[l])
                else:
                    Am=np.zeros((16,8)); Bm=np.zeros((8,8))
                    for l in range(32):
                        g,t=l>>2,l&3
                        Am[g,t]=unpack(af[l][0])[0]; Am[g+8,t]=unpack(af[l][1])[0]
                        Am[g,t+4]=unpack(af[l][2])[0]; Am[g+8,t+4]=unpack(af[l][3])[0]
                        Bm[t,g]=unpack(b0[l])[0]; Bm[t+4,g]=unpack(b1[l])[0]
                D=Am@Bm
                for l in range(32):
                    g,t=l>>2,l&3
                    Dtile[l][0]+=D[g,2*t]; Dtile[l][1]+=D[g,2*t+1]; Dtile[l][2]+=D[g+8,2*t]; Dtile[l][3]+=D[g+8,2*t+1]
            WTM,WTN=BM//WM,BN//WN; MI,NI=WTM//16,WTN//8
            for warp in range(WM*WN):
                wm,wn=warp//WN,warp%WN
                for kk in range(BK//KS):
                    af=[a_frag(wm*WTM+i*16,kk) for i in range(MI)]
                    for j in range(0,NI,2):
                        bf=b_frag2(wn*WTN+j*8,kk)
                        for i in range(MI):
                            for jj,(x,y) in ((j,(0,1)),(j+1,(2,3))):
                                D=[[0.0]*4 for _ in range(32)]
                                mma(D, af[i], [bf[l][x] for l in range(32)], [bf[l][y] for l in range(32)])
                                for l in range(32):
                                    g,t=l>>2,l&3
                                    for c in range(4):
                                        m=wm*WTM+i*16+g+(8 if c>=2 else 0); n=wn*WTN+jj*8+2*t+(c&1)
                                        acc[m,n]+=D[l][c]
        ref=A.astype(float)@B.astype(float)
        err=np.abs(acc[:M,:N]-ref).max()
        assert err==0, err
        assert np.all(acc[M:,:]==0) and np.all(acc[:,N:]==0)
        return err

    cases=[]
    for EL in (2,4):
        for AK in (True,False):
            for BKM in (True,False):
                cfgs=[(128,128,2,2)] + ([(128,256,2,4)] if EL==2 else [])
                for (BM,BN,WM,WN) in cfgs:
                    cases.append((EL,BM,BN,WM,WN,AK,BKM))
    cases.append((2,128,64,2,2,True,True))
    cases += [(1,128,256,2,4,True,True), (1,128,128,2,2,True,True)]   # int8: K-major only
    if "int8" in sys.argv:   # `mma int8`: only the int8 cases
        cases = [c for c in cases if c[0] == 1]
    for c in cases:
        EL,BM,BN,WM,WN,AK,BKM=c
        BK=64//EL
        run(EL,BM,BN,WM,WN,AK,BKM, M=BM-3, N=BN-5, K=BK+BK//2+3)
        print("ok", c, conf); sys.stdout.flush()
        for k in conf: conf[k]=0

def sim_gemv_mma():
    rng=np.random.default_rng(0)
    M,N,K=13,32,96
    A=rng.standard_normal((M,K)); W=rng.standard_normal((N,K))
    # hardware mma m16n8k16: given per-lane regs (each reg = 2 values), build A,B
    def mma(acc, a_regs, b_regs):
        # a_regs[lane] = [a0,a1,a2,a3] each (lo,hi); b_regs[lane] = [b0,b1]
        Am=np.zeros((16,16)); Bm=np.zeros((16,8))
        for lane in range(32):
            g,t=lane//4,lane%4
            a0,a1,a2,a3=a_regs[lane]; b0,b1=b_regs[lane]
            Am[g,2*t:2*t+2]=a0; Am[g+8,2*t:2*t+2]=a1; Am[g,2*t+8:2*t+10]=a2; Am[g+8,2*t+8:2*t+10]=a3
            Bm[2*t:2*t+2,g]=b0; Bm[2*t+8:2*t+10,g]=b1
        D=Am@Bm
        for lane in range(32):
            g,t=lane//4,lane%4
            acc[lane][0]+=D[g,2*t]; acc[lane][1]+=D[g,2*t+1]; acc[lane][2]+=D[g+8,2*t]; acc[lane][3]+=D[g+8,2*t+1]
    NT=4
    acc=[[ [0.0]*4 for _ in range(32)] for j in range(NT)]
    for k0 in range(0,K,32):
        # lane loads
        xl={};xh={};w={}
        for lane in range(32):
            g,t=lane//4,lane%4
            k=k0+8*t
            def load(row):  # 8 elems, words of 2
                v=[row[k+j] if k+j<K else 0 for j in range(8)]
                return [(v[0],v[1]),(v[2],v[3]),(v[4],v[5]),(v[6],v[7])]
            z=[0.0]*K
            xl[lane]=load(A[g] if g<M else z); xh[lane]=load(A[g+8] if g+8<M else z)
            for j in range(NT):
                w[(lane,j)]=load(W[8*j+g])
        for s in range(2):
            a_regs={lane:[xl[lane][2*s],xh[lane][2*s],xl[lane][2*s+1],xh[lane][2*s+1]] for lane in range(32)}
            for j in range(NT):
                b_regs={lane:[w[(lane,j)][2*s],w[(lane,j)][2*s+1]] for lane in range(32)}
                mma(acc[j],a_regs,b_regs)
    C=np.zeros((M,N))
    for j in range(NT):
        for l in range(32):
            for c in range(4):
                m=l//4+(8 if c>=2 else 0); n=8*j+2*(l%4)+(c&1)
                if m<M: C[m,n]=acc[j][l][c]
    print(np.abs(C-A@W.T).max())

def sim_simt():
    PAD=4
    class SimtTile:
        def __init__(s, ROWS, BK, NT): s.ROWS,s.BK,s.NT=ROWS,BK,NT; s.kRuns=ROWS*BK//4//NT; s.kLd=ROWS+PAD
        def init(s, X, sr, sk, R, K, r0, kcontig, tid):
            s.st=[]
            for i in range(s.kRuns):
                q=tid+i*s.NT
                if kcontig: rk=q//(s.BK//4); kk=(q%(s.BK//4))*4
                else: kk=q//(s.ROWS//4); rk=(q%(s.ROWS//4))*4
                r=r0+rk; left=R-r
                rcap=(4 if left>0 else 0) if kcontig else max(0,min(4,left))
                s.st.append([r,kk,K-kk,rcap])
        def load(s, X, k0, kcontig):
            s.v=[]
            for (r,kk,kl,rcap) in s.st:
                along=kl-k0
                n = min(along,rcap) if kcontig else (rcap if along>0 else 0)
                vals=[]
                for j in range(4):
                    if j<n: vals.append(X[r, k0+kk+j] if kcontig else X[r+j, k0+kk])
                    else: vals.append(0.0)
                s.v.append(vals)
        def store(s, S, kcontig, tid):
            for i in range(s.kRuns):
                q=tid+i*s.NT
                if kcontig:
                    r=q//(s.BK//4); k=(q%(s.BK//4))*4
                    for j in range(4): S[(k+j)*s.kLd+r]=s.v[i][j]
                else:
                    k=q//(s.ROWS//4); r=(q%(s.ROWS//4))*4
                    for j in range(4): S[k*s.kLd+r+j]=s.v[i][j]

    def warp_tiled(A, Bs_, M, N, K, ak, bk, dual):
        # X_A = A [M,K]; X_B = B^T [N,K]
        BM,BK=128,8; kSeg=1 if dual else 2; BN=64*kSeg; NB=2 if dual else 1
        tiles_n=(N+BN-1)//BN; tiles_m=(M+BM-1)//BM
        C=[np.full((M,N),np.nan) for _ in range(NB)]
        for tm in range(tiles_m):
            for tn in range(tiles_n):
                m0,n0=tm*BM,tn*BN
                ld_a=BM+PAD; ld_b=BN+PAD
                acc={}
                ktiles=(K+BK-1)//BK
                for kt in range(ktiles):
                    As=np.zeros(BK*ld_a); Bsm=[np.zeros(BK*ld_b) for _ in range(NB)]
                    for tid in range(256):
                        ta=SimtTile(BM,BK,256); ta.init(A,0,0,M,K,m0,ak,tid); ta.load(A,kt*BK,ak); ta.store(As,ak,tid)
                        bsel=tid//128 if dual else 0; btid=tid%128 if dual else tid
                        tb=SimtTile(BN,BK,128 if dual else 256); tb.init(None,0,0,N,K,n0,bk,btid); tb.load(Bs_[bsel].T,kt*BK,bk); tb.store(Bsm[bsel],bk,btid)
                    for tid in range(256):
                        warp,lane=tid//32,tid%32; wm,wn=warp//4,warp%4; ty,tx=lane//4,lane%4
                        a_off=wm*64+ty*4; b_off=wn*(16*kSeg)+tx*4
                        for k in range(BK):
                            a=[As[k*ld_a+a_off+i] for i in range(4)]+[As[k*ld_a+a_off+32+i] for i in range(4)]
                            for d in range(NB):
                                b=[]
                                for s_ in range(kSeg): b+= [Bsm[d][k*ld_b+b_off+16*s_+j] for j in range(4)]
                                for i in range(8):
                                    for j in range(4*kSeg):
                                        acc[(tid,d,i,j)]=acc.get((tid,d,i,j),0.0)+a[i]*b[j]
                for tid in range(256):
                    warp,lane=tid//32,tid%32; wm,wn=warp//4,warp%4; ty,tx=lane//4,lane%4
                    a_off=wm*64+ty*4; b_off=wn*(16*kSeg)+tx*4
                    for i in range(8):
                        m=m0+a_off+(i//4)*32+i%4
                        for s_ in range(kSeg):
                            n=n0+b_off+16*s_
                            for j in range(4):
                                if m<M and n+j<N:
                                    for d in range(NB):
                                        C[d][m,n+j]=acc.get((tid,d,i,4*s_+j),0.0)
        return C
    rng=np.random.default_rng(0)
    for (M,N,K) in ((130,70,19),(5,3,1)):
        A=rng.integers(-3,4,(M,K)).astype(float); B=rng.integers(-3,4,(K,N)).astype(float); B2=rng.integers(-3,4,(K,N)).astype(float)
        for ak in (True,False):
            for bk in (True,False):
                for dual in (False,True):
                    C=warp_tiled(A,[B,B2],M,N,K,ak,bk,dual)
                    assert np.array_equal(C[0],A@B),(M,N,K,ak,bk,dual)
                    if dual: assert np.array_equal(C[1],A@B2)
        print("ok",M,N,K)

def sim_reduce_scatter():
    def log2(n): return 0 if n<=1 else 1+log2(n//2)
    def sim(N):
        rng=np.random.default_rng(N)
        v=[list(rng.standard_normal(N)) for _ in range(32)]
        orig=np.array(v)  # [lane][i]
        total=orig.sum(0)
        n=N; O=16
        while O>0:
            if n>1:
                H=n//2
                new=[]
                for lane in range(32):
                    up=(lane & O)!=0
                    partner=lane^O
                    row=[]
                    for i in range(H):
                        keep = v[lane][i+H] if up else v[lane][i]
                        # partner sends: its send = (partner upper? v[i] : v[i+H])
                        pu=(partner & O)!=0
                        send = v[partner][i] if pu else v[partner][i+H]
                        row.append(keep+send)
                    new.append(row+v[lane][H:])  # rest irrelevant
                v=new; n=H
            else:
                v=[[v[l][0]+v[l^O][0]]+v[l][1:] for l in range(32)]
            O//=2
        H=min(5,log2(N)); NF=max(1,N//32); shift=5-H
        for lane in range(32):
            for i in range(NF):
                e=i+(lane>>shift)*NF
                assert abs(v[lane][i]-total[e])<1e-9,(N,lane,i)
        print("ok",N)
    for N in (1,2,4,8,16,32,64,128):
        sim(N)


def sim_mma_addressing():
    """The addressing of cuda_src/gemm/mma.cu's rebuilt main loop, for every tile configuration
    of gpuops/ops/gemm.py, element size and layout (K tiles of 64 and 128 bytes):
    * the vector path's fixed chunk mapping (MmaOperand::init / load_vec: thread tid's chunk i at
      s_off + i * kRowStep * kRB) covers every chunk of the tile once, at kmajor_off /
      mnmajor_off of its (row, chunk), and each 8-lane phase of every cp.async instruction hits 8
      distinct 16-byte slots of the 128-byte bank window (no conflicts);
    * ldmatrix addresses by XOR / immediate (MmaFrags::load) equal the direct swizzle formula for
      every lane, k step and tile, and each 8-address matrix is conflict-free;
    * the epilogue's staging (stage_col): fragment writes and copy-out reads conflict-free.
    (The functional side, loads + fragments + mma + epilogue, ran in the CPU emulator.)"""
    def kswz(RB, r): return ((r >> 1) & 3) if RB == 64 else (r & 7)
    def kmajor_off(RB, r, c): return r * RB + ((c ^ kswz(RB, r)) << 4)
    def mnmajor_off(EL, r, c, cpr):
        x = (r & 7) if EL == 2 else ((r & 3) << 1)
        return r * cpr * 16 + ((c ^ x) << 4)

    def distinct_slots(addrs):
        return len({(a % 128) // 16 for a in addrs}) == len(addrs)

    # (BM, BN, WM, WN, BKB) of MMA_LARGE, MMA_LARGE_K32, MMA_SMALL, MMA_DUAL (per B)
    configs = [(128, 256, 2, 4, 128), (128, 256, 2, 4, 64), (128, 128, 2, 2, 64), (128, 64, 2, 2, 64)]
    n = 0
    for BM, BN, WM, WN, BKB in configs:
        NT = WM * WN * 32
        for EL in (1, 2, 4):
            for kmajor_a in (True, False):
                for kmajor_b in (True, False):
                    if EL == 1 and not (kmajor_a and kmajor_b):
                        continue
                    if EL == 4 and (BM, BN) != (128, 128):     # TF32: the small tile only
                        continue
                    for ROWS, KM in ((BM, kmajor_a), (BN, kmajor_b)):
                        RB = BKB if KM else ROWS * EL
                        CPR = RB // 16
                        per = ROWS * BKB // 16 // NT
                        step = NT // CPR
                        rows_smem = ROWS if KM else BKB // EL
                        seen = set()
                        for i in range(per):
                            offs = []
                            for tid in range(NT):
                                c, r = tid % CPR, tid // CPR
                                s_off = kmajor_off(RB, r, c) if KM else mnmajor_off(EL, r, c, CPR)
                                off = s_off + i * step * RB
                                rr, cc = r + i * step, c           # the chunk it must be
                                want = kmajor_off(RB, rr, cc) if KM else mnmajor_off(EL, rr, cc, CPR)
                                assert off == want, (BM, BN, BKB, EL, KM, tid, i)
                                seen.add(off)
                                offs.append(off)
                            for ph in range(0, NT, 8):
                                assert distinct_slots(offs[ph:ph + 8]), ("cp.async", BM, BN, EL, KM)
                        assert seen == {16 * q for q in range(rows_smem * CPR)}
                        n += 1
                    # ldmatrix (16-bit and K-major tiles: every dtype K-major, 16-bit M/N-major)
                    WTM, WTN = BM // WM, BN // WN
                    for is_a, KM, ROWS, W in ((True, kmajor_a, BM, WTM), (False, kmajor_b, BN, WTN)):
                        if not KM and EL != 2:
                            continue
                        RB = BKB if KM else ROWS * EL
                        CPR = RB // 16
                        ntiles = W // 16                 # m16 tiles (A) / n8 pairs (B)
                        for w in range(WM if is_a else WN):
                            wbase = w * W
                            for kk in range(BKB // 32):
                                for t in range(ntiles):
                                    addrs = []
                                    for lane in range(32):
                                        if KM:
                                            r = wbase + ((lane & 15) if is_a else (lane & 7) + (lane >> 4) * 8)
                                            h = (lane >> 4) if is_a else (lane >> 3) & 1
                                            lane_off = kmajor_off(RB, r, h)
                                            fast = (lane_off ^ (kk << 5)) + t * 16 * RB
                                            direct = kmajor_off(RB, r + 16 * t, 2 * kk + h)
                                        else:
                                            r = (lane & 7) + ((lane >> 4) * 8 if is_a else ((lane >> 3) & 1) * 8)
                                            h = ((lane >> 3) & 1) if is_a else (lane >> 4)
                                            lane_off = mnmajor_off(2, r, wbase // 8 + h, CPR)
                                            fast = (lane_off ^ (t << 5)) + kk * 16 * RB
                                            direct = mnmajor_off(2, r + 16 * kk, wbase // 8 + 2 * t + h, CPR)
                                        assert fast == direct, (BM, BN, BKB, EL, is_a, KM, lane, kk, t)
                                        addrs.append(fast)
                                    for mtx in range(4):
                                        assert distinct_slots(addrs[8 * mtx:8 * mtx + 8]), "ldmatrix"
                                    n += 1
    # epilogue staging (GemmMma::epilogue): fragment float2 writes (half-warp phases) and the
    # copy-out's two 16-byte reads per run of 8 columns (quarter-warp phases), with stage_col
    def stage_col(c): return c ^ (((c >> 5) & 1) << 2)

    def banks_free(words_per_lane):      # words_per_lane: [[word addresses], ...] of one phase
        used = {}
        for ws in words_per_lane:
            for w in ws:
                used.setdefault(w % 32, set()).add(w)
        return all(len(v) == 1 for v in used.values())

    for BM, BN, WM, WN, BKB in configs:
        NT, ldc = WM * WN * 32, BN + 8
        WTN = BN // WN
        for wn in range(WN):
            for j in range(WTN // 8):
                for half in (0, 16):
                    words = []
                    for lane in range(half, half + 16):
                        g, t = lane >> 2, lane & 3
                        c = stage_col(wn * WTN + j * 8 + 2 * t)
                        words.append([g * ldc + c, g * ldc + c + 1])
                    assert banks_free(words), ("staging write", BN, wn, j)
                    n += 1
        runs = BN // 8
        for q in range(0, NT, 8):             # a quarter warp: 8 threads, one row
            for second in (0, 4):
                words = []
                for tid in range(q, q + 8):
                    r, my_c = tid // runs, (tid % runs) * 8
                    c = stage_col(my_c + second)
                    words.append([r * ldc + c + x for x in range(4)])
                assert banks_free(words), ("copy-out read", BN, q, second)
                n += 1
        assert sorted(stage_col(x) for x in range(BN)) == list(range(BN))   # a permutation
    print("ok: chunk maps, cp.async phases, ldmatrix addresses, epilogue staging:", n, "checks")


SIMS = {"mma": sim_mma, "mma_addressing": sim_mma_addressing, "gemv_mma": sim_gemv_mma,
        "simt": sim_simt, "reduce_scatter": sim_reduce_scatter}

if __name__ == "__main__":
    for name in [a for a in sys.argv[1:] if a in SIMS] or list(SIMS):
        print(f"== {name}")
        SIMS[name]()
